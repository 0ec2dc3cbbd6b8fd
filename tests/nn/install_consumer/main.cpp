// Built against the installed qkv package only (see cmake/check_install.cmake).
#include <iostream>

#include <qkv/nn/nn.hpp>

int main() {
  qkv::nn::DemoOptions options;
  options.steps = 2;
  options.layers = 1;
  options.embed_dim = 16;
  options.heads = 2;
  options.context = 16;
  options.batch = 2;
  options.sample_chars = 10;
  options.threads = 1;
  return qkv::nn::run_demo(options, std::cout);
}
