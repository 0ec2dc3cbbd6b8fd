# Compiler warnings for qkv's own targets (never for users of the installed package).
add_library(qkv_warnings INTERFACE)
target_compile_options(qkv_warnings INTERFACE
  $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion
    -Wno-sign-conversion -Wno-missing-field-initializers -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
    -Woverloaded-virtual -Wnull-dereference>
  $<$<AND:$<BOOL:${QKV_WERROR}>,$<CXX_COMPILER_ID:GNU,Clang>>:-Werror>)
