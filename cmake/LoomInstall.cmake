# Installs the SDK, libloom_core, plugins and the CLI.
include(GNUInstallDirs)
install(TARGETS loom_core EXPORT loomTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY core/include/loom DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
