#!/usr/bin/env bash
# Installs Slurm (controller, node daemon, clients; munge comes as their dependency) from the
# distribution's packages, for tests/slurm/test_slurm.py. Part of the README's test command, so:
#   - idempotent and quiet: nothing is done (no apt-get update) when the packages are present;
#   - it never fails the command: without root (or passwordless sudo) or apt-get it prints why
#     and exits 0, and test_slurm.py skips (or fails, where the CI variable is set).
# Daemons are not started here (the test starts its own, in the foreground) and the packages'
# own services are kept from starting during the installation.
set -u
packages=(slurmctld slurmd slurm-client)
say() { echo "tests/slurm/install.sh: $*" >&2; }

missing=()
for p in "${packages[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  say "no apt-get here: install ${missing[*]} yourself, or the Slurm test is skipped"
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root="sudo -n"
else
  say "not root and no passwordless sudo: cannot install ${missing[*]}; the Slurm test is skipped"
  exit 0
fi

# Debian's convention for "do not start services from maintainer scripts": policy-rc.d
# answering 101. Only ours is removed afterwards, a site's own is left alone.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  if printf '#!/bin/sh\nexit 101\n' | $as_root tee "$policy" >/dev/null \
      && $as_root chmod 755 "$policy"; then
    own_policy=1
  fi
fi
cleanup() { if [ "$own_policy" = 1 ]; then $as_root rm -f "$policy"; fi; }
trap cleanup EXIT

log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
apt() { $as_root apt-get -qq -o DPkg::Lock::Timeout=120 "$@" >>"$log" 2>&1; }
apt_install() { apt install -y --no-install-recommends "${missing[@]}"; }
# the package lists are refreshed only when the packages are not in them, or when they are
# stale (the install fails on a version the mirror no longer has)
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
  apt update
fi
if apt_install || { apt update && apt_install; }; then
  say "installed ${missing[*]}"
else
  say "apt-get could not install ${missing[*]}; the Slurm test is skipped (or fails under CI):"
  tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
