# cmake/cuda.cmake: the CUDA backend (included by the top CMakeLists.txt when PATHATTN_CUDA is ON, or AUTO
# and nvcc is found). Compiles src/cuda/*.cu for sm_90a (H100/H200) and sm_80 (A100) plus compute_80 PTX,
# which the driver compiles for newer GPUs, with explicit -gencode flags (the architecture-specific "a"
# target needs them on CMake < 3.28), adds the objects to `pathattn`, defines
# PATHATTN_WITH_CUDA for the dispatcher, and builds `pathattn_capi`, a small C ABI shared library for
# benchmarks that hold device pointers (bench/gpu_bench.py loads it with ctypes).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES OFF)  # the -gencode flags below choose the targets
endif()
# The CUDA runtime: shared by default; pip builds pass Static (pyproject.toml), so the wheel needs only the
# driver. PATHATTN_CUDART is what the library, the engine and the GPU tests link.
if(NOT CMAKE_CUDA_RUNTIME_LIBRARY)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
string(TOLOWER "${CMAKE_CUDA_RUNTIME_LIBRARY}" _cudart)
if(_cudart STREQUAL "static")
  set(PATHATTN_CUDART CUDA::cudart_static)
elseif(_cudart STREQUAL "shared")
  set(PATHATTN_CUDART CUDA::cudart)
else()
  message(FATAL_ERROR "CMAKE_CUDA_RUNTIME_LIBRARY: expected Shared or Static, got '${CMAKE_CUDA_RUNTIME_LIBRARY}'")
endif()
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(PATHATTN_CUDA_GENCODE
    "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=sm_80;-gencode=arch=compute_80,code=compute_80"
    CACHE STRING "nvcc -gencode flags of the CUDA backend")
# Dev builds only: compile-time switches of src/cuda/heuristics.h for A/B runs between builds, e.g.
# -DPATHATTN_CUDA_DEFINES="-DPATHATTN_CUDA_BWD_OUT_WS=1;-DPATHATTN_CUDA_BWD_SUPER_CHUNKS=8". Empty: the shipped
# choices. The GPU tests see the same switches.
set(PATHATTN_CUDA_DEFINES "" CACHE STRING "compile-time switches of the CUDA backend (src/cuda/heuristics.h)")

set(PATHATTN_CUDA_SOURCES
  src/cuda/backend.cu
  src/cuda/kernels/prep_chunk.cu
  src/cuda/kernels/prep_super.cu
  src/cuda/kernels/fwd_scan.cu
  src/cuda/kernels/fwd_far.cu
  src/cuda/kernels/bwd_delta_dg.cu
  src/cuda/kernels/bwd_q.cu
  src/cuda/kernels/bwd_q_far.cu
  src/cuda/kernels/bwd_k.cu
  src/cuda/kernels/bwd_k_far.cu
  src/cuda/kernels/bwd_super.cu
  src/cuda/kernels/bwd_chunk.cu
  src/cuda/kernels/decode.cu
  src/cuda/kernels/paged_step.cu
  src/cuda/kernels/paged_prefill.cu
  src/cuda/kernels/w_conv_norm.cu
  src/cuda/w_conv_norm.cu
  src/cuda/bwd_run.cu
  src/cuda/pad.cu
  src/cuda/planner.cu
  src/cuda/param_dtypes.cu
)
add_library(pathattn_cuda OBJECT ${PATHATTN_CUDA_SOURCES})
set_target_properties(pathattn_cuda PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
target_include_directories(pathattn_cuda PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_compile_options(pathattn_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${PATHATTN_CUDA_GENCODE} -O3 --expt-relaxed-constexpr>
                       ${PATHATTN_CUDA_DEFINES})
# The far kernels (fwd_far.cu, bwd_q_far.cu, bwd_k_far.cu) have a body only in an sm_90a device pass; the host
# side runs them only when one is built (an sm_90 binary without the "a" features would hold empty kernels).
if(PATHATTN_CUDA_GENCODE MATCHES "code=sm_90a")
  target_compile_definitions(pathattn_cuda PRIVATE PATHATTN_CUDA_SM90A_CODE)
endif()

target_sources(pathattn PRIVATE $<TARGET_OBJECTS:pathattn_cuda>)
set_target_properties(pathattn PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17
                      CUDA_RUNTIME_LIBRARY ${CMAKE_CUDA_RUNTIME_LIBRARY})
target_compile_definitions(pathattn PRIVATE PATHATTN_WITH_CUDA)
target_link_libraries(pathattn PUBLIC ${PATHATTN_CUDART})

add_library(pathattn_capi SHARED src/cuda/capi.cu src/core/validate.cpp src/core/slicing.cpp
  $<TARGET_OBJECTS:pathattn_cuda>)
set_target_properties(pathattn_capi PROPERTIES CUDA_ARCHITECTURES OFF CUDA_RUNTIME_LIBRARY Static)
target_include_directories(pathattn_capi PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
target_compile_options(pathattn_capi PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${PATHATTN_CUDA_GENCODE} -O3>
                       ${PATHATTN_CUDA_DEFINES})
target_compile_definitions(pathattn_capi PRIVATE PATHATTN_WITH_CUDA)
target_link_libraries(pathattn_capi PRIVATE CUDA::cudart_static)
# A symbol left undefined fails the link here rather than the first dlopen on a GPU machine.
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  target_link_options(pathattn_capi PRIVATE -Wl,--no-undefined)
endif()
