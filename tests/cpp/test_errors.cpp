// Every bad call throws qkv::Error with a message naming the argument, the expected and
// the actual value, and leaves every output untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "test_support.hpp"

namespace qkv {
namespace {

constexpr float kSentinel = 12345.0f;

// A valid call (B=2, Nq=3, Nk=4, Hq=4, Hkv=2, d=5, dv=6); each test breaks one thing.
struct ValidCall {
  Tensor<float, 4> q = test::random_tensor<float, 4>({2, 3, 4, 5}, 1);
  Tensor<float, 4> k = test::random_tensor<float, 4>({2, 4, 2, 5}, 2);
  Tensor<float, 4> v = test::random_tensor<float, 4>({2, 4, 2, 6}, 3);
  Tensor<float, 4> out{{2, 3, 4, 6}};
  Tensor<float, 3> lse{{2, 4, 3}};
  Tensor<float, 4> dout = test::random_tensor<float, 4>({2, 3, 4, 6}, 4);
  Tensor<float, 4> dq{{2, 3, 4, 5}}, dk{{2, 4, 2, 5}}, dv{{2, 4, 2, 6}};
  AttentionOptions options;

  ForwardArgs<float> forward_args() {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(), .lse = lse.view()};
  }
  BackwardArgs<float> backward_args() {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
            .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
            .dv = dv.view()};
  }
  void fill_outputs() {
    for (auto* t : {&out, &dq, &dk, &dv}) test::fill(*t, kSentinel);
    test::fill(lse, kSentinel);
  }
  bool outputs_untouched() const {
    for (const auto* t : {&out, &dq, &dk, &dv})
      for (std::size_t i = 0; i < t->size(); ++i)
        if ((*t)[i] != kSentinel) return false;
    for (std::size_t i = 0; i < lse.size(); ++i)
      if (lse[i] != kSentinel) return false;
    return true;
  }
};

// Runs `call`, expects qkv::Error whose message contains every fragment, and checks
// that no output was written.
void expect_error(ValidCall& call, const std::function<void()>& run,
                  std::initializer_list<std::string> fragments) {
  call.fill_outputs();
  try {
    run();
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message \"" << message << "\" lacks \"" << fragment << "\"";
  }
  EXPECT_TRUE(call.outputs_untouched());
}

void expect_forward_error(ValidCall& call, ForwardArgs<float> args,
                          std::initializer_list<std::string> fragments) {
  expect_error(call, [&] { attention_forward(args, call.options); }, fragments);
}
void expect_backward_error(ValidCall& call, BackwardArgs<float> args,
                           std::initializer_list<std::string> fragments) {
  expect_error(call, [&] { attention_backward(args, call.options); }, fragments);
}

TEST(Errors, ValidCallSucceeds) {
  ValidCall call;
  EXPECT_NO_THROW(attention_forward(call.forward_args(), call.options));
  EXPECT_NO_THROW(attention_backward(call.backward_args(), call.options));
}

TEST(Errors, ShapeMismatches) {
  ValidCall call;
  auto args = call.forward_args();
  args.k.shape[0] = 1;
  expect_forward_error(call, args, {"qkv::attention_forward", "k.shape[0] (batch)", "expected 2", "got 1"});
  args = call.forward_args();
  args.k.shape[3] = 4;
  expect_forward_error(call, args, {"k.shape[3] (head_dim)", "expected 5", "got 4"});
  args = call.forward_args();
  args.v.shape[1] = 3;
  expect_forward_error(call, args, {"v.shape[1] (seq)", "expected 4", "got 3"});
  args = call.forward_args();
  args.out.shape[3] = 5;
  expect_forward_error(call, args, {"out.shape[3] (head_dim)", "expected 6", "got 5"});
  args = call.forward_args();
  args.lse.shape[2] = 4;
  expect_forward_error(call, args, {"lse.shape[2] (seq)", "expected 3", "got 4"});
  auto bargs = call.backward_args();
  bargs.dk.shape[2] = 4;
  expect_backward_error(call, bargs, {"qkv::attention_backward", "dk.shape[2] (heads)", "expected 2", "got 4"});
  bargs = call.backward_args();
  bargs.dout.shape[1] = 2;
  expect_backward_error(call, bargs, {"dout.shape[1] (seq)", "expected 3", "got 2"});
}

TEST(Errors, HeadsNotDivisible) {
  ValidCall call;
  Tensor<float, 4> k({2, 4, 3, 5}), v({2, 4, 3, 6});
  auto args = call.forward_args();
  args.k = k.cview();
  args.v = v.cview();
  expect_forward_error(call, args, {"q.shape[2] (heads)", "multiple of k.shape[2]", "= 3", "got 4"});
}

TEST(Errors, InnerStrideMustBeOne) {
  ValidCall call;
  auto args = call.forward_args();
  args.q.shape[3] = 2;
  args.q.strides[3] = 2;
  args.k.shape[3] = 2;
  expect_forward_error(call, args, {"q.strides[3]", "expected 1", "got 2"});
}

TEST(Errors, NegativeStrideOrExtent) {
  ValidCall call;
  auto args = call.forward_args();
  args.v.strides[1] = -12;
  expect_forward_error(call, args, {"v.strides[1]", "expected >= 0", "got -12"});
  args = call.forward_args();
  args.q.shape[1] = -1;
  expect_forward_error(call, args, {"q.shape[1]", "expected >= 0", "got -1"});
}

TEST(Errors, EmptyExtentsThatAreNotAllowed) {
  ValidCall call;
  auto args = call.forward_args();
  args.q.shape[3] = 0;
  expect_forward_error(call, args, {"q.shape[3] (head_dim)", "expected >= 1", "got 0"});
  args = call.forward_args();
  args.q.shape[2] = 0;
  expect_forward_error(call, args, {"q.shape[2] (heads)", "expected >= 1", "got 0"});
  args = call.forward_args();
  args.v.shape[3] = 0;
  expect_forward_error(call, args, {"v.shape[3] (head_dim)", "expected >= 1", "got 0"});
}

TEST(Errors, EmptyViewsMayHaveAnyStrides) {
  // NumPy gives empty arrays all-zero strides: an empty sequence is not a layout error.
  ValidCall call;
  auto args = call.forward_args();
  args.q.shape[1] = 0;
  args.q.strides = {0, 0, 0, 0};
  args.out = View4<float>(call.out.data(), {2, 0, 4, 6}, {0, 0, 0, 0});
  args.lse = View3<float>(call.lse.data(), {2, 4, 0}, {0, 0, 0});
  EXPECT_NO_THROW(attention_forward(args, call.options));
}

TEST(Errors, NullDataForNonEmptyTensor) {
  ValidCall call;
  auto args = call.forward_args();
  args.k.data = nullptr;
  expect_forward_error(call, args, {"k: data is null"});
}

TEST(Errors, MaskNotBroadcastable) {
  ValidCall call;
  Tensor<std::uint8_t, 4> keep({2, 3, 3, 4});  // 3 heads: neither 1 nor 4
  call.options.mask.keep = keep.cview();
  expect_forward_error(call, call.forward_args(),
                       {"mask.keep.shape[1] (heads)", "expected 4", "or 1 to broadcast", "got 3"});
  Tensor<float, 4> bias({1, 1, 3, 5});  // 5 keys, Nk = 4
  call.options.mask.keep = {};
  call.options.mask.bias = bias.cview();
  expect_forward_error(call, call.forward_args(), {"mask.bias.shape[3] (keys)", "expected 4", "got 5"});
}

TEST(Errors, PaddingLengthsOutOfRange) {
  ValidCall call;
  std::vector<int64_t> lengths{4, 5};
  call.options.key_lengths = lengths;
  expect_forward_error(call, call.forward_args(), {"options.key_lengths[1]", "expected 0..4", "got 5"});
  lengths = {-1, 2};
  call.options.key_lengths = lengths;
  expect_forward_error(call, call.forward_args(), {"options.key_lengths[0]", "got -1"});
  std::vector<int64_t> too_few{4};
  call.options.key_lengths = too_few;
  expect_forward_error(call, call.forward_args(),
                       {"options.key_lengths", "one length per batch entry (2)", "got 1"});
}

TEST(Errors, BadScale) {
  ValidCall call;
  for (double scale : {0.0, -1.0, double(NAN), double(INFINITY)}) {
    call.options.scale = scale;
    expect_forward_error(call, call.forward_args(), {"options.scale", "finite value > 0", "got"});
    expect_backward_error(call, call.backward_args(), {"options.scale"});
  }
}

TEST(Errors, NegativeThreads) {
  ValidCall call;
  call.options.execution.threads = -2;
  expect_forward_error(call, call.forward_args(), {"options.execution.threads", "expected >= 0", "got -2"});
}

TEST(Errors, OutputAliasingInput) {
  ValidCall call;
  auto args = call.forward_args();
  // out over v's memory (same element count: 2·4·2·6 = 2·3·4·6 / 1.5…) — use q's buffer.
  Tensor<float, 4> shared({2, 3, 4, 6});
  args.q = View4<const float>(shared.data(), {2, 3, 4, 5}, {72, 24, 6, 1});
  args.out = shared.view();
  expect_forward_error(call, args, {"out: must not share memory with q"});

  auto bargs = call.backward_args();
  bargs.dk = View4<float>(call.dq.data(), {2, 4, 2, 5}, {40, 10, 5, 1});
  expect_backward_error(call, bargs, {"dk: must not share memory with dq"});
  bargs = call.backward_args();
  bargs.dv = View4<float>(const_cast<float*>(call.v.data()), {2, 4, 2, 6}, {48, 12, 6, 1});
  expect_backward_error(call, bargs, {"dv: must not share memory with v"});
}

TEST(Errors, OutputWithOverlappingElements) {
  ValidCall call;
  auto args = call.forward_args();
  args.out.strides[1] = 0;  // every query row written to the same place
  expect_forward_error(call, args, {"out: an output's elements must not overlap"});
}

TEST(Errors, BackwardNeedsLse) {
  ValidCall call;
  auto bargs = call.backward_args();
  bargs.lse = {};
  expect_backward_error(call, bargs, {"lse: required"});
}

TEST(Errors, BackendChoices) {
  ValidCall call;
  Tensor<double, 4> q({1, 1, 1, 2}), k({1, 1, 1, 2}), v({1, 1, 1, 2}), out({1, 1, 1, 2});
  call.options.execution.backend = Backend::cpu;
  expect_error(call,
               [&] {
                 attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view()},
                                   call.options);
               },
               {"options.execution.backend", "double"});
  Tensor<float, 4> weights({2, 4, 3, 4});
  auto args = call.forward_args();
  args.weights = weights.view();
  expect_forward_error(call, args, {"weights", "never materializes"});
}

TEST(Errors, BadEnumValues) {
  ValidCall call;
  call.options.causal = static_cast<Causal>(7);
  expect_forward_error(call, call.forward_args(), {"options.causal", "got value 7"});
  call.options.causal = Causal::none;
  call.options.execution.backend = static_cast<Backend>(9);
  expect_forward_error(call, call.forward_args(), {"options.execution.backend", "unknown value 9"});
}

TEST(Errors, MessageIsExact) {
  ValidCall call;
  auto args = call.forward_args();
  args.k.shape[0] = 3;
  try {
    attention_forward(args);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "qkv::attention_forward: k.shape[0] (batch): expected 2 (as q.shape[0]), got 3");
  }
}

}  // namespace
}  // namespace qkv
