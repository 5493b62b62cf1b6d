# Sourced by the launch scripts, from the repository root. Tools come from PATH (an activated venv, a pip install)
# or else from the repository's .venv, which `make install` (and `make demo`) creates: no activation needed.
find_tool() {  # NAME -> the path of the program to run
  if command -v "$1" >/dev/null 2>&1; then
    command -v "$1"
  elif [[ -x ".venv/bin/$1" ]]; then
    echo "$PWD/.venv/bin/$1"
  else
    echo "sluice: '$1' is neither on PATH nor in $PWD/.venv/bin; run 'make install' in the repository first" >&2
    return 1
  fi
}
