// The CUDA driver API types zero8 reads through cudaGetDriverEntryPointByVersion, as zero8's CUDA
// simulator provides them (ZERO8_CUDA=SIM, tests only).
#pragma once

struct CUctx_st;
using CUcontext = CUctx_st*;
using CUdevice = int;
enum CUresult { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_INVALID_DEVICE = 101 };
