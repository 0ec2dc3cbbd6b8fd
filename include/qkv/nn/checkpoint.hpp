// Training checkpoints: a model's parameters, the AdamW state and the caller's metadata
// in one safetensors file (see safetensors.hpp), written atomically.
//
// Tensors:  "param/<name>"      each parameter
//           "adamw.m/<name>"    AdamW first moment
//           "adamw.v/<name>"    AdamW second moment
// Metadata: "format"            "qkv.nn.checkpoint/1"
//           "dtype"             "F32" or "F64"
//           "adamw.steps"       the optimizer's step count t
//           "data.crc32"        CRC-32 (IEEE) of the data section, hex, so flipped bits
//                               are caught, not just truncation
//           plus every entry of the caller's metadata (model config, RNG state, ...).
//
// Loading checks the format, the dtype, the CRC, and that the file holds exactly the
// parameters the model has, each with the same shape; anything else is a qkv::Error
// naming the file and the first difference.
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "qkv/nn/adamw.hpp"
#include "qkv/nn/parameter.hpp"

namespace qkv::nn {

inline constexpr const char* kCheckpointFormat = "qkv.nn.checkpoint/1";

template <class T>
void save_checkpoint(const std::filesystem::path& path, const ParameterList<T>& parameters,
                     const AdamW<T>& optimizer,
                     const std::map<std::string, std::string>& metadata);

// Restores parameters and optimizer state in place and returns the file's metadata.
// Nothing is changed when it throws.
template <class T>
std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& path,
                                                   const ParameterList<T>& parameters,
                                                   AdamW<T>& optimizer);

// Reads only the metadata (after the same integrity checks), e.g. to build the model a
// checkpoint needs before loading it.
std::map<std::string, std::string> read_checkpoint_metadata(const std::filesystem::path& path);

}  // namespace qkv::nn
