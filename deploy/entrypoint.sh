#!/bin/sh
# The images' entrypoint. An align command runs align: `IMAGE fit --config c.yaml` is `align fit --config c.yaml`,
# and no arguments print align's help. Anything else runs as a program of its own, so the same image starts
# `torchrun ...`, `vllm serve ...` or a shell.
set -e
case "${1:---help}" in
    fit|validate|export|plot|generate|evaluate|chat|-*) exec align "$@" ;;
esac
exec "$@"
