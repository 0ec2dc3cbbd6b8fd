// Built against the installed qkv package only (see cmake/check_install.cmake): a tiny
// transformer learns to repeat a pattern for a few AdamW steps, through qkv::nn alone.
#include <cmath>
#include <cstdint>
#include <iostream>
#include <vector>

#include <qkv/nn/nn.hpp>

int main() {
  qkv::nn::Transformer<float> model({.vocab_size = 5, .context = 8, .embed_dim = 16,
                                     .num_heads = 2, .num_layers = 1,
                                     .execution = {.threads = 1}});
  qkv::nn::Rng rng(1);
  model.reset_parameters(rng);
  const auto parameters = model.parameters();
  qkv::nn::AdamW<float> optimizer(parameters, {.lr = 1e-2});
  std::vector<int32_t> ids(2 * 8), targets(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>(i % 5);
    targets[i] = static_cast<int32_t>((i + 1) % 5);
  }
  double first = 0, loss = 0;
  for (int step = 0; step < 20; ++step) {
    qkv::nn::zero_grad(parameters);
    loss = model.forward_loss(ids, targets, 2, 8);
    if (step == 0) first = loss;
    model.backward();
    optimizer.step();
  }
  std::cout << "loss " << first << " -> " << loss << "\n";
  return std::isfinite(loss) && loss < first ? 0 : 1;
}
