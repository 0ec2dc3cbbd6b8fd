# Cross build for 64-bit Arm Linux on a Debian x86-64 machine: Debian's cross compiler
# (g++-aarch64-linux-gnu) and the arm64 builds of the dependencies installed side by side
# (multiarch: dpkg --add-architecture arm64; libhwy-dev:arm64, libgtest-dev:arm64).
# scripts/test_arm.sh installs them. ctest runs the test programs under qemu-aarch64;
# qemu reads the emulated CPU from QEMU_CPU (e.g. cortex-a72 for NEON only, or
# max,sve256=on for SVE2 with 256-bit vectors): the arm64 test presets set it.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Debian's multiarch layout: the arm64 packages' headers and libraries live under
# /usr/include/aarch64-linux-gnu and /usr/lib/aarch64-linux-gnu of the host's own tree
# (which the cross compiler already searches), their CMake packages under
# /usr/lib/aarch64-linux-gnu/cmake. Search there, never in the host's x86-64 ones.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)

# ctest (and gtest_discover_tests, at build time) run the test programs under qemu. The
# arm64 C library and the other run-time libraries (libgomp1:arm64, libstdc++6:arm64, …)
# are the multiarch packages' under /lib/aarch64-linux-gnu, which the arm64 dynamic
# linker at /lib/ld-linux-aarch64.so.1 searches: qemu needs no -L.
find_program(QKV_QEMU_AARCH64 qemu-aarch64 REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR "${QKV_QEMU_AARCH64}")
