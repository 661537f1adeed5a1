// Key functions of loom's exception types: defining the destructors here gives each type one
// typeinfo, in libloom_core, shared by the host and every plugin.
#include "loom/error.h"

namespace loom {
Error::Error(const std::string& what) : std::runtime_error(what) {}
Error::~Error() = default;
ConfigError::~ConfigError() = default;
PluginError::~PluginError() = default;
CheckpointError::~CheckpointError() = default;
DataError::~DataError() = default;
InternalError::~InternalError() = default;
}  // namespace loom
