// Test plugin, built twice (slot_a, slot_b): both claim the precision slot, so switching both
// on must be a configuration error.
#include "loom/plugin.h"

namespace {
class Claimer final : public loom::Plugin {
 public:
  std::string name() const override { return CLAIMER_NAME; }
  std::string description() const override { return "test: claims the precision slot"; }
  std::vector<loom::Slot> slots() const override { return {loom::Slot::precision}; }
  std::vector<loom::Schema> schemas() const override { return {loom::Schema(CLAIMER_NAME)}; }
};
}  // namespace

LOOM_DEFINE_PLUGIN(Claimer, CLAIMER_NAME, "1.0.0")
