#!/bin/sh
# Render users.acl (comments dropped, passwords hashed) for redis-server, then run the given command (docker-compose.yml: the redis entrypoint).
# Each user's password comes from the environment (docker-compose.yml takes them from .env); the rendered file
# holds only their SHA-256, and goes to a private file redis-server reads with --aclfile.
set -eu
template=${TRAINMEDIC_ACL_TEMPLATE:-/etc/redis/users.acl}
out=${TRAINMEDIC_ACL_OUT:-/tmp/users.acl}

sha() {
  # $1: the variable's name; its value, without a trailing newline, hashed.
  eval "value=\${$1:-}"
  if [ -z "$value" ]; then
    echo "render-acl: $1 is not set (docker-compose.yml takes it from .env; see .env.example)" >&2
    exit 1
  fi
  printf '%s' "$value" | sha256sum | cut -d ' ' -f 1
}

# The stack's node and job (target names: letters, digits and _.:@- only, so they are safe in sed and in ACL rules).
name() {
  eval "value=\${$1:-$2}"
  case "$value" in
    ''|*[!A-Za-z0-9_.:@-]*|?????????????????????????????????????????????????????????????????????????????????????????????????????????????????????????????????*) echo "render-acl: $1 must be 1 to 128 letters, digits or _.:@-" >&2; exit 1 ;;
  esac
  printf '%s' "$value"
}

node=$(name TRAINMEDIC_NODE gpu-node-01)
job=$(name TRAINMEDIC_JOB example-job)
service=$(sha TRAINMEDIC_REDIS_SERVICE_PASSWORD)
agent=$(sha TRAINMEDIC_REDIS_AGENT_PASSWORD)
trainer=$(sha TRAINMEDIC_REDIS_TRAINER_PASSWORD)
# The default user's password: 32 random bytes nobody ever sees (its SHA-256 only is written).
default=$(head -c 32 /dev/urandom | sha256sum | cut -d ' ' -f 1)
umask 077
# redis-server reads no comments in an ACL file: they stay in the template.
sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' -e "s/@SERVICE_PASSWORD_SHA256@/$service/" -e "s/@AGENT_PASSWORD_SHA256@/$agent/" \
    -e "s/@TRAINER_PASSWORD_SHA256@/$trainer/" \
    -e "s/@DEFAULT_PASSWORD_SHA256@/$default/" -e "s/@NODE@/$node/g" -e "s/@JOB@/$job/g" "$template" > "$out"
if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
  chown redis:redis "$out"  # the image's entrypoint runs redis-server as the redis user
fi
exec "$@"
