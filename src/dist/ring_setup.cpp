#include "ring_setup.hpp"

#include <algorithm>
#include <bit>
#include <numeric>
#include <string>

#include "check/checker.hpp"
#include "collective.hpp"

namespace qkv::dist::detail {

void check_ring_options(const qkv::detail::Checker& check, const AttentionOptions& options,
                        const RingOptions& ring) {
  if (!options.mask.empty()) {
    check.fail("options.mask: not supported by ring attention (use causal and key_lengths, "
               "which the ring applies in global positions)");
  }
  if (options.modifiers.active()) {
    check.fail("options.modifiers: not supported by ring attention (each rank's call would see "
               "key positions local to its block)");
  }
  if (ring.progress_rows < 1) {
    check.fail("ring.progress_rows: expected >= 1, got " + std::to_string(ring.progress_rows));
  }
}

namespace {

// What every rank must pass identically, in a fixed order, with names for messages.
enum Field { kBatch, kQHeads, kKvHeads, kDim, kVDim, kCausal, kSharding, kScale, kKeyLengthsCount,
             kKeyLengthsHash, kBackend, kFieldCount };
constexpr const char* kFieldNames[kFieldCount] = {
    "q.shape[0] (batch)", "q.shape[2] (heads)", "k.shape[2] (key/value heads)",
    "q.shape[3] (head_dim)", "v.shape[3] (value head_dim)", "options.causal",
    "ring.sharding", "options.scale", "options.key_lengths (count)",
    "options.key_lengths (values)", "options.execution.backend"};

// FNV-1a over the lengths: equal on every rank iff (but for collisions) the values are.
int64_t hash_lengths(std::span<const int64_t> lengths) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t value : lengths) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (static_cast<uint64_t>(value) >> (8 * byte)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return static_cast<int64_t>(h);
}

std::vector<int64_t> signature(const LocalExtents& e, const AttentionOptions& options,
                               const RingOptions& ring) {
  std::vector<int64_t> s(kFieldCount + 2);
  s[kBatch] = e.batch;
  s[kQHeads] = e.q_heads;
  s[kKvHeads] = e.kv_heads;
  s[kDim] = e.dim;
  s[kVDim] = e.v_dim;
  s[kCausal] = static_cast<int64_t>(options.causal);
  s[kSharding] = static_cast<int64_t>(ring.sharding);
  s[kScale] = options.scale ? std::bit_cast<int64_t>(*options.scale) : -1;
  s[kKeyLengthsCount] = static_cast<int64_t>(options.key_lengths.size());
  s[kKeyLengthsHash] = hash_lengths(options.key_lengths);
  s[kBackend] = static_cast<int64_t>(options.execution.backend);
  s[kFieldCount] = e.q_rows;
  s[kFieldCount + 1] = e.k_rows;
  return s;
}

const char* sharding_name(Sharding sharding) {
  return sharding == Sharding::zigzag ? "zigzag" : "contiguous";
}

// Same verdict on every rank: each sees every rank's signature.
void check_agreement(const char* function, const std::vector<std::vector<int64_t>>& all,
                     Sharding sharding, int64_t q_len, int64_t k_len) {
  const int world = static_cast<int>(all.size());
  for (int r = 1; r < world; ++r) {
    for (int f = 0; f < kFieldCount; ++f) {
      if (all[r][f] == all[0][f]) continue;
      const bool show = f != kScale && f != kKeyLengthsHash;
      throw Error(std::string(function) + ": rank " + std::to_string(r) + ": " + kFieldNames[f] +
                  (show ? " is " + std::to_string(all[r][f]) + ", rank 0's is " + std::to_string(all[0][f])
                        : " differs from rank 0's") +
                  "; every rank must pass the same");
    }
  }
  for (int r = 0; r < world; ++r) {
    const struct { const char* what; int64_t rows, total; } axes[] = {
        {"query", all[r][kFieldCount], q_len}, {"key", all[r][kFieldCount + 1], k_len}};
    for (const auto& axis : axes) {
      const int64_t expected = shard_length(axis.total, world, r, sharding);
      if (axis.rows != expected) {
        throw Error(std::string(function) + ": rank " + std::to_string(r) + " holds " +
                    std::to_string(axis.rows) + " " + axis.what + " rows, but " +
                    sharding_name(sharding) + " sharding of " + std::to_string(axis.total) +
                    " rows over " + std::to_string(world) + " ranks gives it " +
                    std::to_string(expected) + " (see qkv::dist::shard_into)");
      }
    }
  }
}

}  // namespace

int64_t RingSetup::max_k_rows() const {
  return k_rows.empty() ? 0 : *std::max_element(k_rows.begin(), k_rows.end());
}

RingSetup setup_ring(const char* function, const LocalExtents& local,
                     const AttentionOptions& options, MPI_Comm comm, const RingOptions& ring,
                     const std::function<void()>& local_checks) {
  if (comm == MPI_COMM_NULL) throw Error(std::string(function) + ": comm: MPI_COMM_NULL");
  // Local checks first, agreed on before anything else is exchanged.
  agree_on_errors(function, error_of(local_checks), comm);

  RingSetup s;
  check_mpi(MPI_Comm_size(comm, &s.world), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(comm, &s.rank), "MPI_Comm_rank");
  s.next = (s.rank + 1) % s.world;
  s.prev = (s.rank + s.world - 1) % s.world;

  const auto all = allgather_values(signature(local, options, ring), comm);
  for (const auto& r : all) {
    s.q_rows.push_back(r[kFieldCount]);
    s.k_rows.push_back(r[kFieldCount + 1]);
  }
  const int64_t q_len = std::accumulate(s.q_rows.begin(), s.q_rows.end(), int64_t{0});
  const int64_t k_len = std::accumulate(s.k_rows.begin(), s.k_rows.end(), int64_t{0});
  check_agreement(function, all, ring.sharding, q_len, k_len);

  s.problem = RingProblem{.world = s.world, .sharding = ring.sharding, .batch = local.batch,
                          .q_len = q_len, .k_len = k_len, .causal = options.causal,
                          .key_lengths = options.key_lengths};
  try {
    (void)ring_block_calls(s.problem, s.rank, s.rank);  // checks key_lengths against k_len
  } catch (const Error& error) {
    throw Error(std::string(function) + ": " + error.what());  // same on every rank
  }
  s.q_heads = local.q_heads;
  s.block = PackedBlock{.batch = local.batch, .heads = local.kv_heads, .dim = local.dim,
                        .v_dim = local.v_dim};
  s.call_options = options;
  s.call_options.key_lengths = {};
  s.call_options.causal = Causal::none;
  s.call_options.execution.check_finite = false;
  return s;
}

}  // namespace qkv::dist::detail
