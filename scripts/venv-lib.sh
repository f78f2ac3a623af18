# Sourced by the setup scripts: where their environments are cached, and an environment that
# sees the libtorch environment's packages (torch, numpy) instead of downloading them again.

cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"

# Prints the interpreter of scripts/setup-libtorch.sh's environment (installing it when missing).
libtorch_python() {
    local here python
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    python="$("$here/setup-libtorch.sh" --print-env | sed -n 's/^export HORA_TORCH_PYTHON=//p')"
    [ -n "$python" ] || { echo "scripts/setup-libtorch.sh did not name its Python" >&2; return 1; }
    echo "$python"
}

# Makes the virtual environment $1 (when missing) from the interpreter $2, with a .pth file that
# puts $2's site-packages on its path.
venv_seeing() {
    local venv="$1" base="$2" site base_site
    mkdir -p "$cache_root"
    [ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    base_site="$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$base_site" >"$site/hora-torch.pth"
}
