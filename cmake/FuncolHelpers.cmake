# Helpers that give every funcol target the same warnings, sanitizers and test wiring.

# Warnings and sanitizers for a funcol-owned target (never set through CMAKE_CXX_FLAGS).
function(funcol_target_options target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(FUNCOL_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  if(FUNCOL_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${FUNCOL_SANITIZE} -fno-omit-frame-pointer
                                             -fno-sanitize-recover=all)
    target_link_options(${target} PRIVATE -fsanitize=${FUNCOL_SANITIZE})
  endif()
endfunction()

# A library file's name, libNAME.so or .a, perhaps versioned: CMAKE_MATCH_1 is NAME.
set(FUNCOL_LIB_FILE_REGEX "^lib(.+)\\.(so|a)(\\.[0-9.]+)?$")

# funcol_installed_link(OUT LIB): how the installed package names library file LIB for its
# users' link: by name (-l) where the linker looks anyway (this machine's path, versioned at
# that, means nothing elsewhere), else by its path.
function(funcol_installed_link out lib)
  get_filename_component(_dir "${lib}" DIRECTORY)
  get_filename_component(_file "${lib}" NAME)
  if(_dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES AND
     _file MATCHES "${FUNCOL_LIB_FILE_REGEX}")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  else()
    set(${out} "${lib}" PARENT_SCOPE)
  endif()
endfunction()

# Dependencies that are headers only (a user of the installed package needs none of them).
set(FUNCOL_HEADER_ONLY_DEPS nlohmann_json::nlohmann_json CLI11::CLI11)

# funcol_library(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...]): one library per layer.
function(funcol_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(funcol_${name} ${ARG_SOURCES})
  add_library(funcol::${name} ALIAS funcol_${name})
  set_target_properties(funcol_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME funcol_${name})
  # A static library's private dependencies are exported as link-only ones: header-only ones,
  # which link nothing, stay out of the installed package (its users need not install them).
  set(_private "")
  foreach(_dep IN LISTS ARG_PRIVATE_DEPS)
    if(_dep IN_LIST FUNCOL_HEADER_ONLY_DEPS)
      list(APPEND _private "$<BUILD_INTERFACE:${_dep}>")
    else()
      list(APPEND _private "${_dep}")
    endif()
  endforeach()
  target_link_libraries(funcol_${name} PUBLIC funcol_headers ${ARG_PUBLIC_DEPS} PRIVATE ${_private})
  funcol_target_options(funcol_${name})
  set_property(GLOBAL APPEND PROPERTY FUNCOL_LIBRARIES funcol_${name})
endfunction()

# funcol_test(NAME SOURCES ... DEPS ... [TIMEOUT s] [LABELS ...]): a GoogleTest binary run by ctest.
# Every test has a timeout, so a hang fails instead of stalling CI.
function(funcol_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT FUNCOL_BUILD_TESTS)
    return()
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main Threads::Threads)
  funcol_target_options(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  # End-to-end tests (label e2e) run the funcol command, under mpirun too: the main build runs
  # them; the sanitizer builds run the unit tests only (Open MPI's own allocations are not ours).
  if("e2e" IN_LIST ARG_LABELS)
    set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
  else()
    set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "unit;${ARG_LABELS}")
  endif()
  if("tsan" IN_LIST ARG_LABELS)
    add_dependencies(tsan_tests ${name})
  endif()
endfunction()
