// Test plugin: declares memory (Note [Memory declarations] in loom/memory_declarations.h) as a
// technique that keeps `copies` extra copies of the trainable weights in the weights' dtype
// would (an EMA, say), on the device or in host RAM, so a test can check that `loom estimate`
// adds exactly what a job's plugin declares. It does nothing to a run.
#include "loom/plugin.h"

namespace {

class MemoryDeclarer final : public loom::Plugin {
 public:
  std::string name() const override { return "memory_declarer"; }
  std::string description() const override {
    return "test: declares copies of the trainable weights to loom estimate";
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema table("memory_declarer");
    table.key_int("copies", 1, "copies of the trainable weights, in the weights' dtype")
        .key_string("place", "device", "where they live: device | host");
    return {table};
  }
  // After the precision, whose bytes per weight it reads.
  Order order() const override { return {.after = {"precision"}}; }
  void declare_memory(const loom::ConfigSection& table, const loom::memory::MemoryContext& context,
                      loom::memory::MemoryTerms& terms) const override {
    const double bytes =
        static_cast<double>(table.get_int("copies")) * context.trainable * terms.weight_bytes;
    if (table.get_string("place") == "host")
      terms.host_buffers += bytes;
    else
      terms.buffers += bytes;
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(MemoryDeclarer, "memory_declarer", "1.0.0")
