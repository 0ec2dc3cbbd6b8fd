// Checkpoints: round trip of parameters and optimizer state, and clear errors for
// corrupt, foreign and mismatched files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/safetensors.hpp"
#include "qkv/nn/transformer.hpp"

namespace qkv::nn {
namespace {

namespace fs = std::filesystem;

TransformerConfig config(int64_t layers) {
  return {.vocab_size = 9, .context = 8, .embed_dim = 8, .num_heads = 2, .num_layers = layers};
}

struct Trained {
  Transformer<float> model;
  ParameterList<float> params;
  AdamW<float> adam;
  explicit Trained(int64_t layers = 1)
      : model(config(layers)), params(model.parameters()), adam(params, {}) {
    Rng rng(1);
    model.reset_parameters(rng);
  }
  void step() {
    const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8}, targets = {2, 3, 4, 5, 6, 7, 8, 0};
    zero_grad(params);
    model.forward_loss(ids, targets, 1, 8);
    model.backward();
    adam.step();
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

fs::path temp(const char* name) { return testing::temp_path(name); }

TEST(Checkpoint, RoundTripsParametersAndOptimizerState) {
  Trained a;
  a.step();
  a.step();
  const fs::path path = temp("qkv_nn_ckpt");
  save_checkpoint(path, a.params, a.adam, {{"demo.note", "hello"}});
  Trained b;
  const auto metadata = load_checkpoint(path, b.params, b.adam);
  EXPECT_EQ(metadata.at("demo.note"), "hello");
  EXPECT_EQ(metadata.at("format"), kCheckpointFormat);
  EXPECT_EQ(b.adam.steps(), 2);
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    const auto va = a.params[i].parameter->values(), vb = b.params[i].parameter->values();
    ASSERT_TRUE(std::equal(va.begin(), va.end(), vb.begin())) << a.params[i].name;
    const auto ma = a.adam.second_moment(i), mb = b.adam.second_moment(i);
    ASSERT_TRUE(std::equal(ma.begin(), ma.end(), mb.begin())) << a.params[i].name;
  }
  // Continuing both gives the same bits.
  a.step();
  b.step();
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    const auto va = a.params[i].parameter->values(), vb = b.params[i].parameter->values();
    ASSERT_TRUE(std::equal(va.begin(), va.end(), vb.begin())) << a.params[i].name;
  }
  fs::remove(path);
}

TEST(Checkpoint, FlippedBitIsReportedAsCorrupt) {
  Trained a;
  const fs::path path = temp("qkv_nn_ckpt_corrupt");
  save_checkpoint(path, a.params, a.adam, {});
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char c = 0;
    file.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    file.seekp(-100, std::ios::end);
    file.write(&c, 1);
  }
  Trained b;
  const std::vector<float> before(b.params[0].parameter->values().begin(),
                                  b.params[0].parameter->values().end());
  const std::string message = error_of([&] { load_checkpoint(path, b.params, b.adam); });
  EXPECT_NE(message.find("corrupt"), std::string::npos) << message;
  EXPECT_NE(message.find(path.string()), std::string::npos) << message;
  EXPECT_TRUE(std::equal(before.begin(), before.end(), b.params[0].parameter->values().begin()));
  fs::resize_file(path, fs::file_size(path) - 10);  // truncated
  EXPECT_NE(error_of([&] { load_checkpoint(path, b.params, b.adam); }).find("truncated"),
            std::string::npos);
  fs::remove(path);
}

TEST(Checkpoint, MismatchedModelNamesTheTensor) {
  Trained two_layers(2);
  const fs::path path = temp("qkv_nn_ckpt_mismatch");
  save_checkpoint(path, two_layers.params, two_layers.adam, {});
  Trained one_layer(1);
  const std::string message = error_of([&] { load_checkpoint(path, one_layer.params, one_layer.adam); });
  EXPECT_NE(message.find("\"param/blocks.1.ln1.weight\" that this model does not"), std::string::npos)
      << message;

  // Same names, other shape.
  Transformer<float> wide({.vocab_size = 9, .context = 8, .embed_dim = 16, .num_heads = 2, .num_layers = 2});
  ParameterList<float> wide_params = wide.parameters();
  AdamW<float> wide_adam(wide_params, {});
  const std::string shape_message = error_of([&] { load_checkpoint(path, wide_params, wide_adam); });
  EXPECT_NE(shape_message.find("has shape [9, 8], the model expects [9, 16]"), std::string::npos)
      << shape_message;

  // A double model cannot load a float checkpoint.
  Transformer<double> double_model(config(2));
  ParameterList<double> double_params = double_model.parameters();
  AdamW<double> double_adam(double_params, {});
  EXPECT_NE(error_of([&] { load_checkpoint(path, double_params, double_adam); }).find("F32"),
            std::string::npos);
  fs::remove(path);
}

TEST(Checkpoint, ForeignSafetensorsIsNotACheckpoint) {
  const fs::path path = temp("qkv_nn_foreign");
  SafetensorsFile file;
  const std::vector<float> x = {1.0f};
  file.tensors.push_back(SafetensorsTensor::from<float>("x", {1}, x));
  write_safetensors(path, file);
  Trained a;
  EXPECT_NE(error_of([&] { load_checkpoint(path, a.params, a.adam); }).find("not a qkv checkpoint"),
            std::string::npos);
  {
    std::ofstream text(path);
    text << "hello, this is not a checkpoint at all";
  }
  EXPECT_NE(error_of([&] { load_checkpoint(path, a.params, a.adam); }).find("not a safetensors file"),
            std::string::npos);
  fs::remove(path);
}

}  // namespace
}  // namespace qkv::nn
