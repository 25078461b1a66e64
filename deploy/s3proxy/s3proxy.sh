#!/usr/bin/env bash
# S3Proxy (gaul/s3proxy, Apache-2.0): a real S3-compatible server (AWS signature v2/v4, multipart,
# presigned URLs) over a local folder, the object storage of the artifact tests and of local trials.
#   s3proxy.sh fetch   the pinned jar from Maven Central into .cache/m2 (once; Java 17+ runs it)
#   s3proxy.sh path    print the jar's path
# The tests start and stop it themselves (tests/s3_support.py). By hand:
#   printf 's3proxy.endpoint=http://127.0.0.1:8333\ns3proxy.authorization=aws-v2-or-v4\n%s\n' \
#     's3proxy.identity=KEY' 's3proxy.credential=SECRET' 'jclouds.provider=filesystem' \
#     'jclouds.filesystem.basedir=/tmp/s3' > s3.conf && java -jar "$(s3proxy.sh path)" --properties s3.conf
# SeaweedFS was the first choice; its `weed` did not finish building in 50 minutes on two shared cores.
set -euo pipefail
VERSION="${S3PROXY_VERSION:-2.6.0}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
M2="${S3PROXY_M2:-$ROOT/.cache/m2}"
JAR="$M2/org/gaul/s3proxy/$VERSION/s3proxy-$VERSION-jar-with-dependencies.jar"

case "${1:-}" in
  path) echo "$JAR" ;;
  fetch)
    if [ -s "$JAR" ]; then exit 0; fi
    command -v mvn >/dev/null || { echo "s3proxy.sh: mvn not found: install Maven (and Java 17+)" >&2; exit 1; }
    echo "s3proxy.sh: fetching S3Proxy $VERSION into $M2" >&2
    mvn -q -B -Dstyle.color=never -Dmaven.repo.local="$M2" dependency:get \
      -Dartifact="org.gaul:s3proxy:$VERSION:jar:jar-with-dependencies" -Dtransitive=false
    ;;
  *) echo "usage: $0 fetch|path" >&2; exit 2 ;;
esac
