// Driver entry point types zero8 uses (zero8's CUDA simulator, ZERO8_CUDA=SIM, tests only).
#pragma once

#include "cuda.h"

using PFN_cuDevicePrimaryCtxGetState_v7000 = CUresult (*)(CUdevice dev, unsigned* flags, int* active);
using PFN_cuDeviceGet_v2000 = CUresult (*)(CUdevice* dev, int ordinal);
using PFN_cuCtxGetCurrent_v4000 = CUresult (*)(CUcontext* ctx);
