// The software-prefetch table of prefetch_policy.hpp.
#include "cpu/prefetch_policy.hpp"

#include <cstdlib>
#include <string>
#include <strings.h>

#include "qkv/error.hpp"

namespace qkv::cpu {
namespace {

// By vendor, never by timing (the choice changes no bits, but a fixed rule is one a user
// can reproduce). Measured with qkv_dense_probe, fp32 forward, N 4096, 8 heads, 1 thread,
// by thread CPU time:
// - AMD Zen 4 (2026-11-30): at d 128, 77% → 84% of the FMA peak with the next block's
//   K and V requested (commit c29c183); the hardware prefetcher fell behind on long or
//   strided rows.
// - Intel Emerald Rapids (2026-12-07, interleaved runs): the same requests cost the d 128
//   forward 2–20% ([B, H, N, d]: 499–549 ms without them, 540–645 ms with; [B, N, H, d]:
//   526–556 against 618–728 ms), whether into L1 or into L2 only; bfloat16 with the
//   float32 arithmetic (widened rows) 553–562 against 564–739 ms; d 64 with strided rows
//   within the noise (337–445 ms either way). Intel's streamers follow these rows.
// Other CPUs (Arm, unmeasured natively) keep the requests, as before this table. The
// backward's requests (the next query block's operands) stay on everywhere: on the same
// Intel its bfloat16 pass took 468–488 ms with them and 756–1131 ms without.
bool table_says_prefetch() {
#if defined(__x86_64__)
  return !__builtin_cpu_is("intel");
#else
  return true;
#endif
}

bool read_choice() {
  const char* wanted = std::getenv("QKV_PREFETCH");
  if (wanted == nullptr || *wanted == '\0' || strcasecmp(wanted, "auto") == 0) return table_says_prefetch();
  if (strcasecmp(wanted, "on") == 0) return true;
  if (strcasecmp(wanted, "off") == 0) return false;
  throw Error(std::string("QKV_PREFETCH=") + wanted + ": expected auto, on or off");
}

}  // namespace

bool prefetch_next_key_block() {
  static const bool choice = read_choice();  // a bad word throws on every call (the static stays unset)
  return choice;
}

}  // namespace qkv::cpu
