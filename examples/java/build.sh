#!/usr/bin/env bash
# Fetch the pinned jars (examples/java/pom.xml) and compile the Java producer example with javac.
#
#   examples/java/build.sh          prints the classpath to run it with
#   java -cp "$(examples/java/build.sh)" io.dagfold.example.SubmitJobProducer --bootstrap 127.0.0.1:9092
#
# Jars go to .cache/java-producer/libs (refetched when the pom changes), classes to
# .cache/java-producer/classes; the Maven repository is the project's .cache/m2, as for the broker.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/examples/java"
OUT="${JAVA_PRODUCER_OUT:-$ROOT/.cache/java-producer}"
M2="${KAFKA_M2:-$ROOT/.cache/m2}"
LIBS="$OUT/libs"
CLASSES="$OUT/classes"

want="$(sha256sum "$HERE/pom.xml" | cut -d' ' -f1)"
have=""
[[ -f "$LIBS/.pom.sha256" ]] && have="$(cat "$LIBS/.pom.sha256")"
if [[ "$want" != "$have" ]]; then
  command -v mvn >/dev/null || { echo "build.sh: mvn not found (Maven and Java 17+ are needed)" >&2; exit 1; }
  mkdir -p "$LIBS" "$M2"
  rm -f "$LIBS"/*.jar
  mvn -q -B -Dstyle.color=never -f "$HERE/pom.xml" -Dmaven.repo.local="$M2" dependency:copy-dependencies \
    -DoutputDirectory="$LIBS" -DincludeScope=runtime >&2
  echo "$want" > "$LIBS/.pom.sha256"
fi
SRC=$(find "$HERE/src/main/java" -name '*.java' | sort)
stamp="$(cat $SRC "$LIBS/.pom.sha256" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$CLASSES/.src.sha256" || "$(cat "$CLASSES/.src.sha256")" != "$stamp" ]]; then
  rm -rf "$CLASSES" && mkdir -p "$CLASSES"
  javac -nowarn -encoding UTF-8 --release 17 -cp "$LIBS/*" -d "$CLASSES" $SRC >&2
  echo "$stamp" > "$CLASSES/.src.sha256"
fi
echo "$CLASSES:$LIBS/*"
