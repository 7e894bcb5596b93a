#!/bin/sh
# The official Redis image's docker-entrypoint.sh, in short: options alone mean redis-server; as root, give
# /data to the redis user and run redis-server as that user.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi
umask 0077
exec "$@"
