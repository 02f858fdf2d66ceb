# Included by CMake right after the vendored llama.cpp's project() (CMAKE_PROJECT_llama.cpp_INCLUDE,
# set in the Makefile's LLAMA_PACKAGE_ARGS), before its options are read. llama-cpp-python forces
# LLAMA_BUILD_COMMON on, but its Python package loads only libllama and libggml*: the common library
# and the HTTP client it pulls in are half of the compile's CPU time and ship unused.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common library: not loaded by llama_cpp" FORCE)
