// A valid shared library that exports no loom_plugin_entry.
extern "C" __attribute__((visibility("default"))) int some_other_function() { return 42; }
