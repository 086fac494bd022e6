# cmake/blas.cmake: the OpenBLAS behind src/cpu/blas.h, chosen by PATHATTN_BLAS (top-level CMakeLists.txt):
#   system          the system's, through pkg-config (Debian 12: libopenblas-openmp-dev); C++ builds' default.
#   scipy-openblas  the library of the scipy-openblas32 wheel, the OpenBLAS numpy's and SciPy's wheels ship
#                   (symbols prefixed scipy_, pthreads, runtime CPU dispatch): found through the Python that
#                   builds, where pip installs it (pyproject.toml pins it), or in PATHATTN_SCIPY_OPENBLAS_DIR
#                   (the package folder). The Python extension installs it beside itself; pip builds' choice.
# Sets PATHATTN_BLAS_TARGET (what every BLAS user links) and, for scipy-openblas, PATHATTN_SCIPY_OPENBLAS_LIB.
if(PATHATTN_BLAS STREQUAL "system")
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
  set(PATHATTN_BLAS_TARGET PkgConfig::OPENBLAS)
elseif(PATHATTN_BLAS STREQUAL "scipy-openblas")
  set(PATHATTN_SCIPY_OPENBLAS_DIR "" CACHE PATH "scipy_openblas32 package folder (empty: ask the Python that builds)")
  set(_dir "${PATHATTN_SCIPY_OPENBLAS_DIR}")
  if(NOT _dir)
    find_package(Python COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import os, scipy_openblas32 as s; print(os.path.dirname(s.__file__)); print(s.__version__)"
      OUTPUT_VARIABLE _out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "PATHATTN_BLAS=scipy-openblas: ${Python_EXECUTABLE} cannot import scipy_openblas32. "
        "Install the version pyproject.toml pins (pip install scipy-openblas32==...), set "
        "PATHATTN_SCIPY_OPENBLAS_DIR to its package folder, or build with PATHATTN_BLAS=system.")
    endif()
    string(REPLACE "\n" ";" _out "${_out}")
    list(GET _out 0 _dir)
    list(GET _out 1 _version)
    message(STATUS "pathattn: BLAS: scipy-openblas32 ${_version} in ${_dir}")
  endif()
  set(PATHATTN_SCIPY_OPENBLAS_LIB "${_dir}/lib/libscipy_openblas.so")
  if(NOT EXISTS "${PATHATTN_SCIPY_OPENBLAS_LIB}" OR NOT EXISTS "${_dir}/include/cblas.h")
    message(FATAL_ERROR "PATHATTN_BLAS=scipy-openblas: no lib/libscipy_openblas.so and include/cblas.h in ${_dir}")
  endif()
  if(NOT TARGET pathattn::scipy_openblas)
    add_library(pathattn::scipy_openblas SHARED IMPORTED)
    set_target_properties(pathattn::scipy_openblas PROPERTIES
      IMPORTED_LOCATION "${PATHATTN_SCIPY_OPENBLAS_LIB}"
      INTERFACE_INCLUDE_DIRECTORIES "${_dir}/include"
      INTERFACE_COMPILE_DEFINITIONS PATHATTN_BLAS_SCIPY_OPENBLAS)
  endif()
  set(PATHATTN_BLAS_TARGET pathattn::scipy_openblas)
else()
  message(FATAL_ERROR "PATHATTN_BLAS: expected system or scipy-openblas, got '${PATHATTN_BLAS}'")
endif()
