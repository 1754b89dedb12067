#!/usr/bin/env bash
# Make sure the Graphviz `dot` program is available (the Python `graphviz` package needs it).
# Installs it with apt-get (as root) or conda (inside a conda env); otherwise explains how.
set -eu

have_dot() { command -v dot >/dev/null 2>&1; }

have_dot && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq graphviz
elif [ -n "${CONDA_PREFIX:-}" ] && command -v conda >/dev/null 2>&1; then
    conda install -y -c conda-forge graphviz
fi

have_dot && exit 0
echo "minirad: the Graphviz 'dot' program is missing; install it: Debian/Ubuntu 'sudo apt-get install graphviz', macOS 'brew install graphviz', conda 'conda install -c conda-forge graphviz'" >&2
exit 1
