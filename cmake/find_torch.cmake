# find_package(Torch) on a machine that may have no GPU, for the root CMakeLists.txt and
# tests/native/aoti_runner. A CUDA build of libtorch looks for the toolkit at configure time; the nvcc on
# PATH may be a wrapper script outside it, so CUDA_HOME (or /usr/local/cuda) is preferred. Without
# TORCH_CUDA_ARCH_LIST, libtorch's CMake probes the visible GPU (and fails without one).
if(NOT CUDA_TOOLKIT_ROOT_DIR)
  if(DEFINED ENV{CUDA_HOME})
    set(CUDA_TOOLKIT_ROOT_DIR $ENV{CUDA_HOME})
  elseif(EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda)
  endif()
endif()
if(CUDA_TOOLKIT_ROOT_DIR AND NOT CMAKE_CUDA_COMPILER)
  set(CMAKE_CUDA_COMPILER ${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc)
endif()
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  file(STRINGS ${CMAKE_CURRENT_LIST_DIR}/cuda_arch_list.txt arch_list)
  set(ENV{TORCH_CUDA_ARCH_LIST} "${arch_list}")
endif()
find_package(Torch REQUIRED)
