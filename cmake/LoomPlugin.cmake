# loom_add_plugin(<name> SOURCES ... [LINK ...]): one technique, one shared library named
# loom_<name>.so in the plugin folder, linked against the core SDK only.
function(loom_add_plugin name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LINK" ${ARGN})
  set(target loom_plugin_${name})
  add_library(${target} MODULE ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE loom::core ${ARG_LINK})
  target_compile_features(${target} PRIVATE cxx_std_20)  # the SDK's headers need C++20
  set_target_properties(${target} PROPERTIES
    PREFIX "" OUTPUT_NAME "loom_${name}"
    LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIRECTORY}
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  set_property(GLOBAL APPEND PROPERTY LOOM_PLUGIN_TARGETS ${target})
  if(NOT TARGET loom_all_plugins)
    add_custom_target(loom_all_plugins)
  endif()
  add_dependencies(loom_all_plugins ${target})
  if(COMMAND loom_plugin_install_hook)
    loom_plugin_install_hook(${target})
  endif()
endfunction()
