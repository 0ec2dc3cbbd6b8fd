# Turns a text file into a C++ source defining
#   std::string_view qkv::demo::<SYMBOL>()
# that returns the file's bytes. Run at build time:
#   cmake -DINPUT=<file> -DOUTPUT=<file.cpp> -DSYMBOL=<name> -P embed_text.cmake
# A byte array (not a string literal) so any content and any length compile.
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "((0x..,){20})" "\\1\n" bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
"// Generated at build time from ${name} by cli/demo/embed_text.cmake. Do not edit.
#include <string_view>

namespace qkv::demo {
namespace {
const unsigned char kBytes[${size} + 1] = {
${bytes}0x00};
}  // namespace

std::string_view ${SYMBOL}() {
  return std::string_view(reinterpret_cast<const char*>(kBytes), ${size});
}

}  // namespace qkv::demo
")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
