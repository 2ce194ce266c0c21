// The umbrella header: everything a funcol user needs. Tensors and the functional collectives
// (eager, async, wait-on-first-use; the *_autograd variants), process groups and meshes; and
// the compiler: tracing those calls into a Graph, the IR's parser and printer, the passes
// (bucketing, DCE, overlap, autodiff) and the executor that runs a Graph on a rank.
#pragma once

#include "funcol/core/dtype.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/dist/process_group.h"
#include "funcol/dist/work.h"
#include "funcol/api/functional.h"
#include "funcol/api/autograd.h"
#include "funcol/graph/graph.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/tracer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/autodiff.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/dce.h"
#include "funcol/passes/overlap.h"
#include "funcol/passes/pipeline.h"
#include "funcol/runtime/executor.h"
