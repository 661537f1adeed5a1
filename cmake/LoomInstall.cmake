# Installs loom as a CMake package: `find_package(loom)` gives loom::core, loom::sharding and
# loom_add_plugin(), so a third-party plugin builds against the installed SDK
# (examples/third_party_plugin is one; tests/e2e builds it against an install).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LOOM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/loom)
set(LOOM_INSTALL_PLUGINDIR ${CMAKE_INSTALL_LIBDIR}/loom/plugins)

# Exported as loom::core, loom::sharding, loom::offload, loom::torch: the build tree's names.
set_target_properties(loom_core PROPERTIES EXPORT_NAME core)
set_target_properties(loom_sharding PROPERTIES EXPORT_NAME sharding)
set_target_properties(loom_offload PROPERTIES EXPORT_NAME offload)
set_target_properties(loom_torch PROPERTIES EXPORT_NAME torch)
install(TARGETS loom_core loom_sharding loom_offload EXPORT loomTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS loom_torch EXPORT loomTargets)
if(TARGET loom_cuda)  # loaded by libloom_core from its own folder (core/src/cuda_runtime.h)
  install(TARGETS loom_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  set_target_properties(loom_cuda PROPERTIES INSTALL_RPATH "$ORIGIN;${LOOM_TORCH_LIBDIR}")
  if(TARGET loom_cuda_kernels)  # Note [loom's own CUDA kernels]: beside libloom_cuda
    install(TARGETS loom_cuda_kernels LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  endif()
  if(TARGET loom_optim_cuda)  # the optim plugin's kernels, found by its $ORIGIN/../..
    install(TARGETS loom_optim_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  endif()
endif()
install(TARGETS loom loom-launch RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY core/include/loom sharding/include/loom offload/include/loom DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${LOOM_SDK_DIGEST_HEADER} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/loom)
get_property(_plugins GLOBAL PROPERTY LOOM_PLUGIN_TARGETS)
foreach(target ${_plugins})
  install(TARGETS ${target} LIBRARY DESTINATION ${LOOM_INSTALL_PLUGINDIR})
endforeach()
# Installed binaries find libloom_* next to them, plugins find them two folders up, so the
# prefix can move; LibTorch stays where the build found it (LOOM_TORCH_LIBDIR, LoomTorch.cmake).
set_target_properties(loom_core loom_sharding loom_offload PROPERTIES INSTALL_RPATH "$ORIGIN;${LOOM_TORCH_LIBDIR}")
set_target_properties(loom loom-launch PROPERTIES
  INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR};${LOOM_TORCH_LIBDIR}")
foreach(target ${_plugins})
  set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../..;${LOOM_TORCH_LIBDIR}")
endforeach()

install(EXPORT loomTargets NAMESPACE loom:: DESTINATION ${LOOM_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/loomConfig.cmake.in
  ${CMAKE_BINARY_DIR}/loomConfig.cmake INSTALL_DESTINATION ${LOOM_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/loomConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/loomConfig.cmake ${CMAKE_BINARY_DIR}/loomConfigVersion.cmake
  cmake/LoomPlugin.cmake cmake/LoomFindTorch.cmake DESTINATION ${LOOM_INSTALL_CMAKEDIR})
