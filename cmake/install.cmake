# `cmake --install` puts headers, the library and a CMake package (qkv::qkv) under the
# prefix, so `find_package(qkv)` works for users.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS qkv qkv_nn EXPORT qkvTargets
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
