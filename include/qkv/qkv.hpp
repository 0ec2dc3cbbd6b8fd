// qkv — exact, fast scaled dot-product attention. Include this one header.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/decode.hpp"
#include "qkv/dropout.hpp"
#include "qkv/error.hpp"
#include "qkv/half.hpp"
#include "qkv/index_topk.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/mla.hpp"
#include "qkv/names.hpp"
#include "qkv/options.hpp"
#include "qkv/softmax.hpp"
#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"
#include "qkv/threads.hpp"
#include "qkv/version.hpp"
