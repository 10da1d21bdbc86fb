# Install rules and the CMake package config, so a C++ project can
#   find_package(zero8 REQUIRED)  and  target_link_libraries(app PRIVATE zero8::zero8)
# The installed config re-finds the dependencies this build linked (OpenMP, Threads, and MPI / the
# CUDA toolkit / NCCL when the build used them), as the exported targets name them.
include(CMakePackageConfigHelpers)

set(ZERO8_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/zero8 CACHE STRING
    "Where zero8Config.cmake is installed, relative to the prefix")

install(TARGETS zero8_kernels zero8_comm zero8_core EXPORT zero8Targets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# Public headers of each layer; private headers stay in src/ and are not installed. comm/include
# may not exist yet in every tree, hence OPTIONAL.
foreach(layer kernels comm zero8)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          OPTIONAL FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp" PATTERN "*.cuh")
endforeach()

install(EXPORT zero8Targets NAMESPACE zero8:: DESTINATION ${ZERO8_INSTALL_CMAKEDIR})

# Where this build found the CUDA toolkit, as a hint for the consumer's find_package(CUDAToolkit).
set(ZERO8_CUDA_TOOLKIT_ROOT "")
if(ZERO8_WITH_CUDA AND CUDAToolkit_BIN_DIR)
  get_filename_component(ZERO8_CUDA_TOOLKIT_ROOT ${CUDAToolkit_BIN_DIR} DIRECTORY)
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/zero8Config.cmake.in
  ${PROJECT_BINARY_DIR}/zero8Config.cmake INSTALL_DESTINATION ${ZERO8_INSTALL_CMAKEDIR})
# 0.x: minor versions may break the API, so a request for 0.1 accepts 0.1.* only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zero8ConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/zero8Config.cmake ${PROJECT_BINARY_DIR}/zero8ConfigVersion.cmake
        DESTINATION ${ZERO8_INSTALL_CMAKEDIR})
