// Training checkpoints on top of safetensors: parameters, AdamW moments and step,
// caller metadata, and a CRC-32 of the data section.
#include "qkv/nn/checkpoint.hpp"

#include <array>
#include <cstdio>
#include <cstring>
#include <string>

#include "qkv/error.hpp"
#include "qkv/nn/safetensors.hpp"

namespace qkv::nn {
namespace {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), table-driven.
class Crc32 {
 public:
  Crc32() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table_[i] = c;
    }
  }
  void update(const std::vector<std::byte>& bytes) {
    for (std::byte b : bytes) {
      crc_ = table_[(crc_ ^ static_cast<uint32_t>(b)) & 0xFFu] ^ (crc_ >> 8);
    }
  }
  std::string hex() const {
    char text[9];
    std::snprintf(text, sizeof text, "%08x", crc_ ^ 0xFFFFFFFFu);
    return text;
  }

 private:
  std::array<uint32_t, 256> table_{};
  uint32_t crc_ = 0xFFFFFFFFu;
};

std::string data_crc(const SafetensorsFile& file) {
  Crc32 crc;
  for (const auto& tensor : file.tensors) crc.update(tensor.bytes);
  return crc.hex();
}

template <class T>
constexpr const char* dtype_label() {
  return std::is_same_v<T, float> ? "F32" : "F64";
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Reads the file and checks what every checkpoint must have: format, CRC.
SafetensorsFile read_verified(const std::filesystem::path& path) {
  SafetensorsFile file = read_safetensors(path);
  const std::string what = "checkpoint " + path.string();
  const auto format = file.metadata.find("format");
  if (format == file.metadata.end() || format->second != kCheckpointFormat) {
    throw Error(what + ": not a qkv checkpoint (metadata \"format\" is " +
                (format == file.metadata.end() ? std::string("missing")
                                               : "\"" + format->second + "\"") +
                ", expected \"" + kCheckpointFormat + "\")");
  }
  const auto stored_crc = file.metadata.find("data.crc32");
  const std::string actual_crc = data_crc(file);
  if (stored_crc == file.metadata.end() || stored_crc->second != actual_crc) {
    throw Error(what + ": corrupt: the data's CRC-32 is " + actual_crc + ", the header says " +
                (stored_crc == file.metadata.end() ? std::string("nothing") : stored_crc->second));
  }
  return file;
}

}  // namespace

template <class T>
void save_checkpoint(const std::filesystem::path& path, const ParameterList<T>& parameters,
                     const AdamW<T>& optimizer,
                     const std::map<std::string, std::string>& metadata) {
  if (optimizer.parameters().size() != parameters.size()) {
    throw Error("save_checkpoint: the optimizer has " +
                std::to_string(optimizer.parameters().size()) + " parameters, the list " +
                std::to_string(parameters.size()));
  }
  SafetensorsFile file;
  file.metadata = metadata;
  for (const auto& [name, parameter] : parameters) {
    file.tensors.push_back(SafetensorsTensor::from<T>("param/" + name, parameter->shape,
                                                      parameter->values()));
  }
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto& [name, parameter] = parameters[i];
    if (optimizer.parameters()[i].parameter != parameter) {
      throw Error("save_checkpoint: parameter " + name + " is not the optimizer's parameter " +
                  std::to_string(i));
    }
    file.tensors.push_back(
        SafetensorsTensor::from<T>("adamw.m/" + name, parameter->shape, optimizer.first_moment(i)));
    file.tensors.push_back(SafetensorsTensor::from<T>("adamw.v/" + name, parameter->shape,
                                                      optimizer.second_moment(i)));
  }
  file.metadata["format"] = kCheckpointFormat;
  file.metadata["dtype"] = dtype_label<T>();
  file.metadata["adamw.steps"] = std::to_string(optimizer.steps());
  file.metadata["data.crc32"] = data_crc(file);
  write_safetensors(path, file);
}

template <class T>
std::map<std::string, std::string> load_checkpoint(const std::filesystem::path& path,
                                                   const ParameterList<T>& parameters,
                                                   AdamW<T>& optimizer) {
  const SafetensorsFile file = read_verified(path);
  const std::string what = "checkpoint " + path.string();
  const auto dtype = file.metadata.find("dtype");
  if (dtype == file.metadata.end() || dtype->second != dtype_label<T>()) {
    throw Error(what + ": holds " +
                (dtype == file.metadata.end() ? std::string("untyped") : dtype->second) +
                " tensors, this model is " + dtype_label<T>());
  }
  if (optimizer.parameters().size() != parameters.size()) {
    throw Error("load_checkpoint: the optimizer has " +
                std::to_string(optimizer.parameters().size()) + " parameters, the list " +
                std::to_string(parameters.size()));
  }
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    if (optimizer.parameters()[i].parameter != parameters[i].parameter) {
      throw Error("load_checkpoint: parameter " + parameters[i].name +
                  " is not the optimizer's parameter " + std::to_string(i));
    }
  }
  int64_t steps = -1;
  try {
    steps = std::stoll(file.metadata.at("adamw.steps"));
  } catch (const std::exception&) {
    throw Error(what + ": metadata \"adamw.steps\" is missing or not an integer");
  }
  // Check everything before changing anything.
  std::vector<const SafetensorsTensor*> found;
  for (const auto& [name, parameter] : parameters) {
    for (const char* group : {"param/", "adamw.m/", "adamw.v/"}) {
      const SafetensorsTensor* tensor = file.find(group + name);
      if (tensor == nullptr) {
        throw Error(what + ": has no tensor \"" + group + name +
                    "\" (a checkpoint of a different model?)");
      }
      if (tensor->shape != parameter->shape) {
        throw Error(what + ": tensor \"" + group + name + "\" has shape " +
                    shape_text(tensor->shape) + ", the model expects " +
                    shape_text(parameter->shape));
      }
      if (tensor->dtype != (std::is_same_v<T, float> ? Dtype::f32 : Dtype::f64)) {
        throw Error(what + ": tensor \"" + group + name + "\" has dtype " +
                    dtype_name(tensor->dtype) + ", expected " + dtype_label<T>());
      }
      found.push_back(tensor);
    }
  }
  if (found.size() != file.tensors.size()) {
    for (const auto& tensor : file.tensors) {
      bool known = false;
      for (const SafetensorsTensor* f : found) known = known || f == &tensor;
      if (!known) {
        throw Error(what + ": has tensor \"" + tensor.name +
                    "\" that this model does not (a checkpoint of a different model?)");
      }
    }
  }
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto copy = [](const SafetensorsTensor& from, std::span<T> to) {
      std::memcpy(to.data(), from.bytes.data(), from.bytes.size());
    };
    copy(*found[3 * i], parameters[i].parameter->values());
    copy(*found[3 * i + 1], optimizer.first_moment(i));
    copy(*found[3 * i + 2], optimizer.second_moment(i));
  }
  optimizer.set_steps(steps);
  return file.metadata;
}

std::map<std::string, std::string> read_checkpoint_metadata(const std::filesystem::path& path) {
  return read_verified(path).metadata;
}

template void save_checkpoint(const std::filesystem::path&, const ParameterList<float>&,
                              const AdamW<float>&, const std::map<std::string, std::string>&);
template void save_checkpoint(const std::filesystem::path&, const ParameterList<double>&,
                              const AdamW<double>&, const std::map<std::string, std::string>&);
template std::map<std::string, std::string> load_checkpoint(const std::filesystem::path&,
                                                            const ParameterList<float>&,
                                                            AdamW<float>&);
template std::map<std::string, std::string> load_checkpoint(const std::filesystem::path&,
                                                            const ParameterList<double>&,
                                                            AdamW<double>&);

}  // namespace qkv::nn
