// Charts through gnuplot (Debian: gnuplot-nox), run as a child process on a script file.
#pragma once

#include <filesystem>
#include <string>

namespace qkv::cli {

// Throws qkv::Error unless `output` ends in .png or .svg and gnuplot is on PATH, so a
// command can refuse a --plot it cannot honour before doing any work.
void check_plot_target(const std::filesystem::path& output);

// Runs `script` (gnuplot commands that plot but set neither terminal nor output) into a
// width×height PNG or SVG at `output`. The picture appears atomically: gnuplot draws into
// a temporary next to `output`, which is renamed into place only if gnuplot succeeded.
// Throws qkv::Error with gnuplot's own message if it fails.
void render_gnuplot(const std::string& script, const std::filesystem::path& output, int width,
                    int height);

// `text` as a gnuplot single-quoted string literal (a quote inside is doubled).
std::string gnuplot_quote(const std::string& text);

}  // namespace qkv::cli
