// The umbrella header: everything a funcol user needs.
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
