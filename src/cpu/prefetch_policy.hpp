// Whether the fused forward requests the next key block's K and V rows ahead of use
// (software prefetch): a fixed table by CPU vendor, switchable for measurement.
// Prefetching changes no result, only speed.
#pragma once

namespace qkv::cpu {

// True where requesting the next K/V block ahead was measured to pay; see
// prefetch_policy.cpp. The environment variable QKV_PREFETCH (read
// once, case-insensitive) overrides the table: auto (or unset), on, off; another word
// makes every kernel call that asks throw qkv::Error.
bool prefetch_next_key_block();

}  // namespace qkv::cpu
