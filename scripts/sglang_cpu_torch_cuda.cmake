# Included after project() in SGLang's sgl-kernel CPU build (CMAKE_PROJECT_INCLUDE), by
# scripts/setup.sh --sglang-cpu. The registry's torch 2.11.0 is a CUDA build: its CMake config looks
# for the CUDA toolkit and stops without it, although the CPU kernels use none of CUDA. With the
# target torch::cudart already defined, torch's public/cuda.cmake returns at its include guard; the
# kernels link torch's own libraries (libcudart comes from the nvidia wheels torch loads at import).
if(NOT TARGET torch::cudart)
  add_library(torch::cudart INTERFACE IMPORTED)
endif()
