// qkv::nn — layers around the attention core, enough to train a small transformer.
// Include this one header (and link qkv::nn).
#pragma once

#include "qkv/nn/adamw.hpp"
#include "qkv/nn/threads.hpp"
#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/clip.hpp"
#include "qkv/nn/cross_entropy.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/gelu.hpp"
#include "qkv/nn/layer_norm.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/mlp.hpp"
#include "qkv/nn/multihead_attention.hpp"
#include "qkv/nn/parameter.hpp"
#include "qkv/nn/random.hpp"
#include "qkv/nn/safetensors.hpp"
#include "qkv/nn/transformer.hpp"
