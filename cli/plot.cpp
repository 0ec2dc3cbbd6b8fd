#include "plot.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string_view>
#include <vector>

#include "qkv/error.hpp"

extern char** environ;

namespace qkv::cli {
namespace {

std::string lower_extension(const std::filesystem::path& path) {
  std::string ext = path.extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/bin:/bin";
  while (true) {
    const std::size_t colon = dirs.find(':');
    const std::string dir(dirs.substr(0, colon));
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return true;
    if (colon == std::string_view::npos) return false;
    dirs.remove_prefix(colon + 1);
  }
}

// A uniquely named file that is removed when this object goes away.
class TempFile {
 public:
  TempFile(const std::filesystem::path& near, const std::string& suffix) {
    std::random_device entropy;
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::ostringstream name;
      name << near.string() << ".tmp-" << ::getpid() << "-" << std::hex << entropy() << suffix;
      const int fd = ::open(name.str().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd >= 0) {
        ::close(fd);
        path_ = name.str();
        return;
      }
      if (errno != EEXIST) {
        throw Error("qkv: " + near.string() + ": cannot create a file next to it: " +
                    std::strerror(errno));
      }
    }
    throw Error("qkv: " + near.string() + ": cannot find a free temporary name next to it");
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

std::string read_tail(const std::string& path, std::size_t limit) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  while (!all.empty() && (all.back() == '\n' || all.back() == ' ')) all.pop_back();
  return all.size() > limit ? "..." + all.substr(all.size() - limit) : all;
}

}  // namespace

std::string gnuplot_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) {
    quoted += c;
    if (c == '\'') quoted += '\'';
  }
  return quoted + "'";
}

void check_plot_target(const std::filesystem::path& output) {
  const std::string ext = lower_extension(output);
  if (ext != ".png" && ext != ".svg") {
    throw Error("--plot " + output.string() + ": the file name must end in .png or .svg");
  }
  if (!on_path("gnuplot")) {
    throw Error("--plot needs gnuplot, which is not on PATH (Debian: apt-get install gnuplot-nox)");
  }
  std::error_code error;
  const auto parent = output.parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent, error)) {
    throw Error("--plot " + output.string() + ": the directory " + parent.string() +
                " does not exist");
  }
}

void render_gnuplot(const std::string& script, const std::filesystem::path& output, int width,
                    int height) {
  check_plot_target(output);
  const bool png = lower_extension(output) == ".png";
  TempFile picture(output, png ? ".png" : ".svg");
  TempFile script_file(output, ".gp");
  TempFile log(output, ".log");

  std::ostringstream full;
  full << "set encoding utf8\n";
  if (png) {
    // pngcairo draws antialiased text and lines; plain png (libgd) is the fallback.
    full << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
         << "  set terminal pngcairo size " << width << "," << height
         << " enhanced font 'sans,10' background rgb 'white'\n"
         << "} else {\n"
         << "  set terminal png size " << width << "," << height << " enhanced\n"
         << "}\n";
  } else {
    full << "set terminal svg size " << width << "," << height
         << " enhanced font 'sans,10' background rgb 'white'\n";
  }
  full << "set output " << gnuplot_quote(picture.path()) << "\n" << script << "\nunset output\n";
  {
    std::ofstream out(script_file.path());
    out << full.str();
    if (!out.flush()) throw Error("qkv: cannot write the gnuplot script " + script_file.path());
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.path().c_str(), O_WRONLY | O_TRUNC, 0);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::string program = "gnuplot";
  std::string script_arg = script_file.path();
  char* argv[] = {program.data(), script_arg.data(), nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) throw Error(std::string("qkv: cannot start gnuplot: ") + std::strerror(spawned));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw Error(std::string("qkv: waiting for gnuplot: ") + std::strerror(errno));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw Error("gnuplot failed drawing " + output.string() + ": " + read_tail(log.path(), 600));
  }
  struct stat info {};
  if (::stat(picture.path().c_str(), &info) != 0 || info.st_size == 0) {
    throw Error("gnuplot wrote nothing to " + output.string() + ": " + read_tail(log.path(), 600));
  }
  if (std::rename(picture.path().c_str(), output.c_str()) != 0) {
    throw Error("qkv: " + output.string() + ": cannot move the picture into place: " +
                std::strerror(errno));
  }
  picture.release();
}

}  // namespace qkv::cli
