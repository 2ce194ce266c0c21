# lit configuration of funcol's text tests: RUN lines call `funcol` and LLVM's FileCheck.
#
# ctest passes the tool paths (--param funcol=... llvm_bin=... exec_root=...); without them,
# `lit test/lit` from the repository root uses build/bin/funcol and /usr/lib/llvm-14/bin.
import os
import re

import lit.formats

config.name = 'funcol'
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = ['.ir']
config.excludes = ['Inputs']

config.test_source_root = os.path.dirname(os.path.abspath(__file__))
repo_root = os.path.dirname(os.path.dirname(config.test_source_root))
params = lit_config.params
# Output/ scratch files go to the build tree, never into the sources.
config.test_exec_root = params.get('exec_root', os.path.join(repo_root, 'build', 'test', 'lit'))

funcol = params.get('funcol', os.path.join(repo_root, 'build', 'bin', 'funcol'))
llvm_bin = params.get('llvm_bin', '/usr/lib/llvm-14/bin')
if not os.path.exists(funcol):
    lit_config.fatal('funcol binary not found at %s (build it, or pass --param funcol=PATH)' % funcol)

# Whole-word tool names at the start of a command (not inside paths or option names).
def tool(name, path):
    return (r'(?<![\w/.%-])' + name + r'(?![\w/.-])', path)

# The version `funcol --version` prints: the one project() declares.
with open(os.path.join(repo_root, 'CMakeLists.txt')) as f:
    version = re.search(r'project\(funcol VERSION (\S+)', f.read())
if version is None:
    lit_config.fatal('no project(funcol VERSION ...) in CMakeLists.txt')
config.substitutions.append(('%funcol_version', version.group(1)))

config.substitutions.append(tool('funcol', funcol))
config.substitutions.append(tool('FileCheck', os.path.join(llvm_bin, 'FileCheck')))
config.substitutions.append(tool('not', os.path.join(llvm_bin, 'not')))

# A stable environment: no colours, the C locale.
config.environment['LC_ALL'] = 'C'
