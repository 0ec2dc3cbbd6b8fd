// qkv run: attention forward (and backward) on .npy files.
//
//   q, k, v      [seq, heads, dim] or [batch, seq, heads, dim] (--layout bshd, default),
//                [heads, seq, dim] or [batch, heads, seq, dim] (--layout bhsd, PyTorch's)
//   --mask       [B|1, H|1, Nq|1, Nk] or fewer leading axes (NumPy broadcasting, as
//                PyTorch's attn_mask): bool/uint8 = keep, float32 = additive bias
//   -o out       like q, with v's head dim        --lse      [B, H, Nq] ([H, Nq] for 3-D)
//   --weights    [B, H, Nq, Nk] ([H, Nq, Nk])     --grad dout like out → --dq/--dk/--dv
//
// Every input is read and every shape checked (errors name the file), then everything is
// computed, then all outputs are written to temporaries and only then renamed into
// place: on any error no output file is created or changed.
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <vector>

#include "command.hpp"
#include "format.hpp"
#include "npy.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

using npy::shape_string;  // messages name shapes the way the .npy header does

enum class Layout { bshd, bhsd };

// Outputs above this many elements are refused instead of exhausting memory
// (2³¹ floats = 8 GiB; --weights of a long sequence is the usual way to get there).
constexpr int64_t kMaxOutputElements = int64_t{1} << 31;

struct RunFlags {
  std::string q, k, v, mask, out, lse, weights, grad, dq, dk, dv;
  Causal causal = Causal::none;
  Layout layout = Layout::bshd;
  std::optional<double> scale;
  Backend backend = Backend::automatic;
  int threads = 0;
  bool check_finite = false;
  bool quiet = false;
};

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

// An attention operand read from a file: its array and its logical extents.
struct Operand {
  std::string path;
  npy::Array<float> array;
  int rank = 0;
  int64_t batch = 1, seq = 0, heads = 0, dim = 0;

  // The logical [batch, seq, heads, dim] view of the file's memory, whatever its layout.
  View4<const float> view(Layout layout) const {
    if (layout == Layout::bhsd) return View4<const float>::from_bhsd(array.data.data(), batch, heads, seq, dim);
    return View4<const float>::contiguous(array.data.data(), {batch, seq, heads, dim});
  }
};

const char* axes(Layout layout, int rank) {
  if (layout == Layout::bhsd) return rank == 3 ? "[heads, seq, dim]" : "[batch, heads, seq, dim]";
  return rank == 3 ? "[seq, heads, dim]" : "[batch, seq, heads, dim]";
}

Operand load_operand(const std::string& path, Layout layout, const char* role) {
  Operand operand;
  operand.path = path;
  operand.array = npy::read_float32(path);
  const auto& shape = operand.array.shape;
  operand.rank = static_cast<int>(shape.size());
  if (operand.rank != 3 && operand.rank != 4) {
    fail(path + ": " + role + " has shape " + shape_string(shape) + "; expected 3-D " +
         axes(layout, 3) + " or 4-D " + axes(layout, 4) + " (--layout " +
         (layout == Layout::bshd ? "bshd" : "bhsd") + ")");
  }
  const std::size_t o = operand.rank == 4 ? 1 : 0;
  if (operand.rank == 4) operand.batch = shape[0];
  if (layout == Layout::bshd) {
    operand.seq = shape[o];
    operand.heads = shape[o + 1];
  } else {
    operand.heads = shape[o];
    operand.seq = shape[o + 1];
  }
  operand.dim = shape[o + 2];
  if (operand.heads < 1) fail(path + ": " + role + " has " + std::to_string(operand.heads) + " heads; expected at least 1");
  if (operand.dim < 1) fail(path + ": " + role + " has head dim " + std::to_string(operand.dim) + "; expected at least 1");
  return operand;
}

// The file shape of an output shaped like q (or k, v) but with head dim `dim`.
std::vector<int64_t> file_shape(Layout layout, int rank, int64_t batch, int64_t seq, int64_t heads,
                                int64_t dim) {
  std::vector<int64_t> shape;
  if (rank == 4) shape.push_back(batch);
  if (layout == Layout::bshd) {
    shape.insert(shape.end(), {seq, heads, dim});
  } else {
    shape.insert(shape.end(), {heads, seq, dim});
  }
  return shape;
}

// An output buffer with the shape it will have on disk.
struct Output {
  std::string path;
  std::vector<int64_t> shape;
  std::vector<float> data;

  Output(std::string path_, std::vector<int64_t> shape_, const char* flag) : path(std::move(path_)), shape(std::move(shape_)) {
    int64_t numel = 1;
    for (int64_t extent : shape) {
      if (extent != 0 && numel > kMaxOutputElements / extent) numel = kMaxOutputElements + 1;
      else numel *= extent;
    }
    if (numel > kMaxOutputElements) {
      fail(path + ": " + flag + " would have shape " + shape_string(shape) + ", more than " +
           std::to_string(kMaxOutputElements) + " elements");
    }
    data.assign(static_cast<std::size_t>(numel), 0.0f);
  }
  View4<float> view(Layout layout, int64_t batch, int64_t seq, int64_t heads, int64_t dim) {
    if (layout == Layout::bhsd) return View4<float>::from_bhsd(data.data(), batch, heads, seq, dim);
    return View4<float>::contiguous(data.data(), {batch, seq, heads, dim});
  }
};

void check_same(const Operand& a, const Operand& b, int64_t a_value, int64_t b_value,
                const char* what) {
  if (a_value != b_value) {
    fail(b.path + ": " + what + " is " + std::to_string(b_value) + ", but " + a.path + " has " +
         std::to_string(a_value));
  }
}

// The mask, right-aligned against [batch, heads, Nq, Nk] like NumPy broadcasting.
struct MaskInput {
  npy::Array<float> bias;
  npy::Array<std::uint8_t> keep;
  std::array<int64_t, 4> shape{};
  bool is_bias = false;
};

MaskInput load_mask(const std::string& path, int64_t batch, int64_t heads, int64_t q_len,
                    int64_t k_len) {
  MaskInput mask;
  const npy::Header header = npy::read_header(path);
  mask.is_bias = header.dtype == npy::DType::float32;
  std::vector<int64_t> shape;
  if (mask.is_bias) {
    mask.bias = npy::read_float32(path);
    shape = mask.bias.shape;
  } else {
    mask.keep = npy::read_uint8(path);
    shape = mask.keep.shape;
  }
  const std::array<int64_t, 4> full{batch, heads, q_len, k_len};
  const std::string expected = "[batch " + std::to_string(batch) + " or 1, heads " +
                               std::to_string(heads) + " or 1, queries " + std::to_string(q_len) +
                               " or 1, keys " + std::to_string(k_len) + "]";
  if (shape.empty() || shape.size() > 4) {
    fail(path + ": mask has shape " + shape_string(shape) + "; expected 1 to 4 axes of " + expected);
  }
  const std::size_t missing = 4 - shape.size();
  static constexpr const char* kAxis[] = {"batch", "heads", "queries", "keys"};
  for (std::size_t axis = 0; axis < 4; ++axis) {
    const int64_t extent = axis < missing ? 1 : shape[axis - missing];
    const bool ok = axis == 3 ? extent == full[3] : (extent == full[axis] || extent == 1);
    if (!ok) {
      fail(path + ": mask has shape " + shape_string(shape) + ", which does not broadcast to " +
           expected + " (" + kAxis[axis] + " axis is " + std::to_string(extent) + ")");
    }
    mask.shape[axis] = extent;
  }
  return mask;
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::map<std::filesystem::path, std::string> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    std::error_code error;
    auto canonical = std::filesystem::weakly_canonical(path, error);
    if (error) canonical = std::filesystem::absolute(path);
    const auto [it, inserted] = seen.emplace(canonical, flag);
    if (!inserted) fail(flag + " and " + it->second + " both name " + path);
  }
}

int run_attention(const RunFlags& flags, Streams streams) {
  const bool backward = !flags.grad.empty();
  const bool any_grad_output = !flags.dq.empty() || !flags.dk.empty() || !flags.dv.empty();
  if (backward && !any_grad_output) fail("--grad needs at least one of --dq, --dk, --dv to write");
  if (!backward && any_grad_output) fail("--dq, --dk and --dv need --grad dout.npy (the gradient of the output)");
  check_distinct_outputs({{"-o", flags.out}, {"--lse", flags.lse}, {"--weights", flags.weights},
                          {"--dq", flags.dq}, {"--dk", flags.dk}, {"--dv", flags.dv}});

  // ---- read and check every input --------------------------------------------------
  const Layout layout = flags.layout;
  const Operand q = load_operand(flags.q, layout, "q");
  const Operand k = load_operand(flags.k, layout, "k");
  const Operand v = load_operand(flags.v, layout, "v");
  for (const Operand* other : {&k, &v}) {
    if (other->rank != q.rank) {
      fail(other->path + " has " + std::to_string(other->rank) + " axes but " + q.path + " has " +
           std::to_string(q.rank) + ": q, k and v must all be " + axes(layout, 3) + " or all " +
           axes(layout, 4));
    }
    check_same(q, *other, q.batch, other->batch, "the batch size");
  }
  check_same(k, v, k.seq, v.seq, "the number of keys (seq)");
  check_same(k, v, k.heads, v.heads, "the number of heads");
  check_same(q, k, q.dim, k.dim, "the head dim");
  if (q.heads % k.heads != 0) {
    fail(q.path + ": " + std::to_string(q.heads) + " query heads is not a multiple of " + k.path +
         "'s " + std::to_string(k.heads) + " key/value heads (grouped-query attention needs one)");
  }
  const int64_t B = q.batch, Nq = q.seq, Nk = k.seq, H = q.heads, dv_dim = v.dim;

  std::optional<MaskInput> mask;
  if (!flags.mask.empty()) mask = load_mask(flags.mask, B, H, Nq, Nk);

  std::optional<Operand> dout;
  const std::vector<int64_t> out_shape = file_shape(layout, q.rank, B, Nq, H, dv_dim);
  if (backward) {
    dout = load_operand(flags.grad, layout, "dout");
    if (dout->array.shape != out_shape) {
      fail(dout->path + ": dout has shape " + shape_string(dout->array.shape) +
           "; expected the output's shape " + shape_string(out_shape));
    }
  }

  // ---- compute ----------------------------------------------------------------------
  AttentionOptions options;
  options.scale = flags.scale;
  options.causal = flags.causal;
  options.execution.backend = flags.backend;
  options.execution.threads = flags.threads;
  options.execution.check_finite = flags.check_finite;
  if (mask) {
    if (mask->is_bias) {
      options.mask.bias = TensorView<const float, 4>::contiguous(mask->bias.data.data(), mask->shape);
    } else {
      options.mask.keep = TensorView<const std::uint8_t, 4>::contiguous(mask->keep.data.data(), mask->shape);
    }
  }

  const auto drop_batch = [&](std::vector<int64_t> shape) {
    if (q.rank == 3) shape.erase(shape.begin());
    return shape;
  };
  Output out(flags.out, out_shape, "-o");
  // The log-sum-exp is needed by the backward even when not written.
  Output lse(flags.lse, drop_batch({B, H, Nq}), "--lse");
  std::optional<Output> weights;
  if (!flags.weights.empty()) weights.emplace(flags.weights, drop_batch({B, H, Nq, Nk}), "--weights");

  ForwardArgs<float> forward{.q = q.view(layout), .k = k.view(layout), .v = v.view(layout),
                             .out = out.view(layout, B, Nq, H, dv_dim),
                             .lse = View3<float>::contiguous(lse.data.data(), {B, H, Nq})};
  if (weights) forward.weights = View4<float>::contiguous(weights->data.data(), {B, H, Nq, Nk});
  attention_forward(forward, options);

  std::vector<Output*> written{&out};
  if (!flags.lse.empty()) written.push_back(&lse);
  if (weights) written.push_back(&*weights);

  std::optional<Output> dq, dk, dv;
  if (backward) {
    dq.emplace(flags.dq, q.array.shape, "--dq");
    dk.emplace(flags.dk, k.array.shape, "--dk");
    dv.emplace(flags.dv, v.array.shape, "--dv");
    attention_backward({.q = q.view(layout), .k = k.view(layout), .v = v.view(layout),
                        .out = out.view(layout, B, Nq, H, dv_dim),
                        .lse = View3<const float>::contiguous(lse.data.data(), {B, H, Nq}),
                        .dout = dout->view(layout),
                        .dq = dq->view(layout, B, Nq, H, q.dim),
                        .dk = dk->view(layout, B, Nk, k.heads, k.dim),
                        .dv = dv->view(layout, B, Nk, v.heads, dv_dim)},
                       options);
    for (Output* o : {&*dq, &*dk, &*dv}) {
      if (!o->path.empty()) written.push_back(o);
    }
  }

  // ---- write: stage everything, then move everything into place ---------------------
  std::vector<npy::StagedWrite> staged;
  for (const Output* o : written) {
    staged.emplace_back(o->path, npy::serialize(o->shape, o->data));
  }
  for (npy::StagedWrite& file : staged) file.commit();
  if (!flags.quiet) {
    for (const Output* o : written) {
      streams.out << "wrote " << o->path << "  float32 " << shape_string(o->shape) << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

Command register_run(CLI::App& parent) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* app = parent.add_subcommand(
      "run", "Attention (forward, and backward with --grad) on float32 .npy files");
  app->footer(
      "out = softmax(scale·Q·Kᵀ + mask)·V. q, k, v: float32 .npy in C order, shaped\n"
      "[seq, heads, dim] or [batch, seq, heads, dim] (--layout bhsd: [batch, heads, seq, dim],\n"
      "PyTorch's order). k and v share seq and heads; q's heads must be a multiple of k's (GQA).\n"
      "Outputs come in the inputs' layout; --lse is [batch, heads, Nq], --weights\n"
      "[batch, heads, Nq, Nk] (batch left out for 3-D inputs). Every input is checked before\n"
      "anything is computed, and outputs are written atomically only if everything succeeded.\n"
      "Example: qkv run --q q.npy --k k.npy --v v.npy --causal top_left -o out.npy");
  app->add_option("--q", flags->q, "Queries .npy")->required()->type_name("FILE");
  app->add_option("--k", flags->k, "Keys .npy")->required()->type_name("FILE");
  app->add_option("--v", flags->v, "Values .npy")->required()->type_name("FILE");
  app->add_option("-o,--out", flags->out, "Output .npy to write (shaped like q, v's head dim)")
      ->required()
      ->type_name("FILE");
  add_choice<Layout>(app, "--layout", flags->layout, {{"bshd", Layout::bshd}, {"bhsd", Layout::bhsd}},
                     "Axis order of q, k, v and the outputs: bshd = [batch, seq, heads, dim], "
                     "bhsd = [batch, heads, seq, dim] (PyTorch's); batch may be left out");
  add_choice<Causal>(app, "--causal", flags->causal,
                     choices_of(kCausalNames),
                     "Causal mask: top_left as PyTorch's is_causal, bottom_right as FlashAttention's");
  app->add_option("--mask", flags->mask,
                  "Mask .npy broadcastable to [batch, heads, Nq, Nk]: bool/uint8 keeps where "
                  "true, float32 is added to the scaled logits (-inf removes)")
      ->type_name("FILE");
  app->add_option("--scale", flags->scale, "Multiplies Q·Kᵀ (default 1/√d)");
  app->add_option("--lse", flags->lse, "Also write the log-sum-exp of each row, [batch, heads, Nq]")
      ->type_name("FILE");
  app->add_option("--weights", flags->weights,
                  "Also write the attention weights P, [batch, heads, Nq, Nk] (reference backend)")
      ->type_name("FILE");
  app->add_option("--grad", flags->grad, "Gradient of the output (shaped like the output): run the backward")
      ->type_name("FILE");
  app->add_option("--dq", flags->dq, "Write ∂L/∂q (needs --grad)")->type_name("FILE");
  app->add_option("--dk", flags->dk, "Write ∂L/∂k (needs --grad)")->type_name("FILE");
  app->add_option("--dv", flags->dv, "Write ∂L/∂v (needs --grad)")->type_name("FILE");
  add_choice<Backend>(app, "--backend", flags->backend,
                      choices_of(kBackendNames), "Backend (auto: the fastest that supports the call)");
  app->add_option("--threads", flags->threads, "Threads (0: all); results never depend on it")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_flag("--check-finite", flags->check_finite,
                "Refuse inputs with NaN or Inf, naming the first one");
  app->add_flag("--quiet", flags->quiet, "Print nothing on success");
  return {app, [flags](Streams streams) { return run_attention(*flags, streams); }};
}

}  // namespace qkv::cli
