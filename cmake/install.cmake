# `cmake --install` puts headers, the library and a CMake package (qkv::qkv) under the
# prefix, so `find_package(qkv)` works for users.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# qkv::dist is installed only when it was built (MPI found); the package then asks its
# users' CMake for MPI too (qkvConfig.cmake).
# qkv::nn is left out of a QKV_BUILD_NN=OFF build.
set(qkv_installed_targets qkv)
if(TARGET qkv_nn)
  list(APPEND qkv_installed_targets qkv_nn)
endif()
list(APPEND qkv_installed_targets qkv_ring_plan)
set(QKV_HAS_DIST OFF)
if(TARGET qkv_dist)
  list(APPEND qkv_installed_targets qkv_dist)
  set(QKV_HAS_DIST ON)
endif()
install(TARGETS ${qkv_installed_targets} EXPORT qkvTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/qkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT qkvTargets NAMESPACE qkv:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)

configure_package_config_file(cmake/qkvConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)
