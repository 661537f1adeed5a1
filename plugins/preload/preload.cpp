// The `preload` plugin: replaces the data source, in the setup event, by a PreloadSource whose
// worker threads prepare the coming batches while the trainer computes. Not a sampler or a
// dataset: order, drop_last ([data] drop_last) and checkpoint positions stay the core's.
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "preload_source.h"

namespace {

class PreloadPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "preload"; }
  std::string description() const override {
    return "prepare batches on worker threads ahead of the trainer (DataLoader's num_workers, "
           "prefetch_factor, pin_memory)";
  }
  std::vector<loom::Schema> schemas() const override {
    return {loom::Schema("preload")
                .key_int("num_workers", 2, "worker threads (0 = prepare on the training thread)")
                .key_int("prefetch_factor", 2, "batches prepared ahead per worker")
                .key_bool("persistent_workers", false,
                          "keep the workers across epochs (false: new ones each epoch)")
                .key_bool("pin_memory", true,
                          "CUDA: page-locked batches, copied to the device on a side stream")};
  }

  void configure(const loom::ConfigSection& table) override {
    options_.num_workers = table.get_int("num_workers");
    options_.prefetch_factor = table.get_int("prefetch_factor");
    options_.persistent_workers = table.get_bool("persistent_workers");
    options_.pin_memory = table.get_bool("pin_memory");
    LOOM_CHECK_AS(ConfigError, options_.num_workers >= 0, table.where("num_workers"),
                  ": [preload] num_workers must be >= 0 (0 = no worker threads), got ",
                  options_.num_workers);
    LOOM_CHECK_AS(ConfigError, options_.prefetch_factor >= 1, table.where("prefetch_factor"),
                  ": [preload] prefetch_factor must be >= 1 (batches ahead per worker), got ",
                  options_.prefetch_factor);
  }

  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::setup, [this](loom::Engine& e) {
      auto* sampled = dynamic_cast<loom::SampledSource*>(&e.data());
      LOOM_CHECK_AS(ConfigError, sampled != nullptr,
                    "[preload] can only wrap the core's sampled data source, but the data "
                    "source is '", e.data().describe(), "' (already wrapped by another plugin?)");
      options_.device = e.device();
      if (options_.pin_memory && !options_.device.is_cuda())
        loom::log::debug("[preload] pin_memory applies to CUDA devices only; on ",
                         options_.device.str(), " batches are queued unpinned");
      auto wrapped = std::make_unique<loom::preload::PreloadSource>(
          sampled->dataset(), sampled->sampler().options(), options_);
      wrapped->seek(sampled->position());
      e.set_data(std::move(wrapped));
    });
  }

 private:
  loom::preload::PreloadOptions options_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(PreloadPlugin, "preload", "1.0.0")
