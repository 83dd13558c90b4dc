#!/usr/bin/env bash
# Install SLURM (slurmctld, slurmd, the client commands) and MUNGE from Debian's packages, if missing.
#
# Idempotent: does nothing when every program is already on PATH (VIME_SLURM_FORCE_INSTALL=1 runs the
# apt-get steps anyway, to test them on a machine that has SLURM). Needs root and apt-get.
# Exit codes: 0 ready; 77 cannot install here (not root, no apt-get, package install failed) with
# the reason on stderr, so the caller can skip instead of failing; anything else is a bug.
set -uo pipefail

needed=(munged mungekey slurmctld slurmd sbatch srun scontrol squeue scancel)
missing=()
for prog in "${needed[@]}"; do
  command -v "$prog" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$prog" >/dev/null 2>&1 || missing+=("$prog")
done
if [ ${#missing[@]} -eq 0 ] && [ -z "${VIME_SLURM_FORCE_INSTALL:-}" ]; then
  echo "slurm-install: already installed ($(PATH="$PATH:/usr/sbin" slurmd -V 2>/dev/null))"
  exit 0
fi
echo "slurm-install: missing ${missing[*]:-nothing}; installing slurm-wlm and munge"

skip() { echo "slurm-install: cannot install SLURM here: $*" >&2; exit 77; }
[ "$EUID" -eq 0 ] || skip "not running as root (apt-get needs root)"
command -v apt-get >/dev/null 2>&1 || skip "apt-get not found (not a Debian/Ubuntu machine)"

export DEBIAN_FRONTEND=noninteractive
# Packages must not start system daemons (munged, slurmd, slurmctld) that would outlive the test:
# a policy-rc.d that says "no" (exit 101) stops invoke-rc.d, as in Docker images. Removed afterwards.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# temporary, from vime tests/slurm/install.sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi
# The package index of a fresh machine is empty or stale: update first.
apt-get update -qq || skip "apt-get update failed"
# slurm-wlm pulls slurmctld + slurmd + slurm-client; no recommends keeps it small (no mail, no docs).
apt-get install -y -qq --no-install-recommends slurm-wlm munge \
  || skip "apt-get install slurm-wlm munge failed"

for prog in "${needed[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$prog" >/dev/null 2>&1 || skip "installed the packages but $prog is still missing"
done
echo "slurm-install: installed ($(PATH="$PATH:/usr/sbin" slurmd -V))"
