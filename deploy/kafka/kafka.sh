#!/usr/bin/env bash
# Run a local Apache Kafka (KRaft) for dagfold's tests and `make kafka-up`, no Docker needed.
#
#   deploy/kafka/kafka.sh fetch    copy the broker jars pinned by deploy/kafka/pom.xml into .cache/kafka/libs
#   deploy/kafka/kafka.sh start    format (first time) and start the broker(s), wait until ready
#   deploy/kafka/kafka.sh stop     SIGTERM, wait, then SIGKILL; harmless if not running
#   deploy/kafka/kafka.sh status   exit 0 when every broker runs
#
# Environment (see deploy/kafka/README.md):
#   KAFKA_PORT=9092      client port of broker 1 (broker i listens on KAFKA_PORT+i-1,
#                        its controller on KAFKA_PORT+1000+i-1)
#   KAFKA_BROKERS=1      1, or 3 for a 3-voter KRaft quorum with replication factor 3
#   KAFKA_HOST=127.0.0.1 the address every broker listens on and advertises (a test network's hub address)
#   KAFKA_HOSTS=         or one address per broker, comma-separated (brokers on hosts of their own)
#   KAFKA_NETNS=         network namespaces, one per broker, comma-separated: broker i runs in the i-th
#                        (`ip netns exec`, needs root), listening on its KAFKA_HOSTS address there
#   KAFKA_DATA=.cache/kafka/data-$KAFKA_PORT   config, logs, pid files and storage
#   KAFKA_HEAP_OPTS="-Xmx512m -Xms256m"        per broker
#   KAFKA_START_TIMEOUT=90                     seconds to wait for readiness
#   KAFKA_LIBS=.cache/kafka/libs-<version>     jars (fetch fills it; one folder per pinned version, so
#                                              checkouts pinning another version never clobber it)
#   KAFKA_SECURITY=none                        or sasl: clients authenticate with SASL/SCRAM-SHA-256 and
#                                              ACLs apply (StandardAuthorizer, nothing allowed without an
#                                              ACL); the super user is "admin" (also between brokers and
#                                              controllers, over SASL/PLAIN). Create principals and ACLs
#                                              as admin (dagfold.localkafka.SecureLocalKafka.add_user/allow).
#   KAFKA_ADMIN_PASSWORD                       admin's password (required with sasl; kept in the node's
#                                              server.properties, mode 0600)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
POM="$ROOT/deploy/kafka/pom.xml"
M2="${KAFKA_M2:-$ROOT/.cache/m2}"
KAFKA_VERSION="$(grep -o '<kafka.version>[^<]*' "$POM" | cut -d'>' -f2)"
LIBS="${KAFKA_LIBS:-$ROOT/.cache/kafka/libs-$KAFKA_VERSION}"
PORT="${KAFKA_PORT:-9092}"
BROKERS="${KAFKA_BROKERS:-1}"
DATA="${KAFKA_DATA:-$ROOT/.cache/kafka/data-$PORT}"
HEAP="${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m}"
START_TIMEOUT="${KAFKA_START_TIMEOUT:-90}"
HOST="${KAFKA_HOST:-127.0.0.1}"
IFS=, read -r -a HOSTS <<<"${KAFKA_HOSTS:-}"
IFS=, read -r -a NETNS <<<"${KAFKA_NETNS:-}"
SECURITY="${KAFKA_SECURITY:-none}"
ADMIN_PASSWORD="${KAFKA_ADMIN_PASSWORD:-}"

die() { echo "kafka.sh: $*" >&2; exit 1; }

case "$BROKERS" in 1|3) ;; *) die "KAFKA_BROKERS must be 1 or 3 (got $BROKERS)";; esac
((${#HOSTS[@]} == 0 || ${#HOSTS[@]} == BROKERS)) || die "KAFKA_HOSTS needs one address per broker ($BROKERS)"
((${#NETNS[@]} == 0 || ${#NETNS[@]} == BROKERS)) || die "KAFKA_NETNS needs one namespace per broker ($BROKERS)"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "KAFKA_PORT must be a number (got $PORT)"
case "$SECURITY" in
  none) ;;
  sasl) [[ "$ADMIN_PASSWORD" =~ ^[A-Za-z0-9_.-]{8,}$ ]] ||
          die "KAFKA_SECURITY=sasl needs KAFKA_ADMIN_PASSWORD (8+ characters of [A-Za-z0-9_.-])" ;;
  *) die "KAFKA_SECURITY must be none or sasl (got $SECURITY)" ;;
esac

node_ids() { seq 1 "$BROKERS"; }
client_port() { echo $((PORT + $1 - 1)); }
controller_port() { echo $((PORT + 1000 + $1 - 1)); }
node_dir() { echo "$DATA/node-$1"; }
# the address broker $1 listens on: its own (KAFKA_HOSTS) or the common one
host_of() { if ((${#HOSTS[@]})); then echo "${HOSTS[$1 - 1]}"; else echo "$HOST"; fi; }
# the command prefix that runs broker $1 in its namespace (KAFKA_NETNS), or nothing
netns_of() { if ((${#NETNS[@]})); then echo "ip netns exec ${NETNS[$1 - 1]}"; fi; }
bootstrap() {
  local out="" id
  for id in $(node_ids); do out+="${out:+,}$(host_of "$id"):$(client_port "$id")"; done
  echo "$out"
}

# -- fetch -------------------------------------------------------------------
# The stamp holds the pom's checksum, so editing the pom refetches (into a clean folder:
# copy-dependencies never removes jars that are no longer wanted).
fetch() {
  local want have=""
  want="$(sha256sum "$POM" | cut -d' ' -f1)"
  [[ -f "$LIBS/.pom.sha256" ]] && have="$(cat "$LIBS/.pom.sha256")"
  if [[ "$want" == "$have" ]] && compgen -G "$LIBS/kafka_2.13-*.jar" >/dev/null; then
    return 0
  fi
  command -v mvn >/dev/null || die "mvn not found: install Maven (and Java 17+) to fetch the broker"
  echo "kafka.sh: fetching broker jars into $LIBS" >&2
  mkdir -p "$LIBS" "$M2"
  rm -f "$LIBS"/*.jar
  mvn -q -B -Dstyle.color=never -f "$POM" -Dmaven.repo.local="$M2" dependency:copy-dependencies \
    -DoutputDirectory="$LIBS" -DincludeScope=runtime
  echo "$want" >"$LIBS/.pom.sha256"
}

# slf4j-api 1.7 (what Kafka 4.1 pulls in) needs a 1.x binding such as log4j-slf4j-impl; an
# slf4j 2.x provider (slf4j-reload4j 2.x) is ignored and the broker then logs nothing at all.
check_logging_binding() {
  if compgen -G "$LIBS/slf4j-api-1.*.jar" >/dev/null &&
    ! compgen -G "$LIBS/log4j-slf4j-impl-*.jar" >/dev/null &&
    ! compgen -G "$LIBS/slf4j-reload4j-1.*.jar" >/dev/null; then
    echo "kafka.sh: warning: no SLF4J 1.x binding in $LIBS, so the broker log stays empty;" \
      "deploy/kafka/pom.xml should depend on org.apache.logging.log4j:log4j-slf4j-impl" >&2
  fi
}

kafka_java() { java $HEAP -cp "$LIBS/*" "$@"; }

# -- config ------------------------------------------------------------------
write_configs() {
  local id dir voters="" rf isr
  for id in $(node_ids); do voters+="${voters:+,}$id@$(host_of "$id"):$(controller_port "$id")"; done
  if ((BROKERS >= 3)); then rf=3 isr=2; else rf=1 isr=1; fi
  mkdir -p "$DATA"
  # Kafka 4 logs through log4j2 (log4j-slf4j-impl); log4j.properties covers an slf4j-reload4j
  # binding. Both keep the broker to WARN, with the few lines that say it started.
  cat >"$DATA/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = STDOUT
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
EOF
  cat >"$DATA/log4j.properties" <<'EOF'
log4j.rootLogger=WARN, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaRaftServer=INFO
EOF
  if [[ "$SECURITY" == sasl ]]; then  # admin's client settings, for the readiness check and the CLI tools
    (umask 077 && cat >"$DATA/admin-client.properties" <<EOF
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-256
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$ADMIN_PASSWORD";
EOF
    )
  fi
  for id in $(node_ids); do
    dir="$(node_dir "$id")"
    mkdir -p "$dir"
    (umask 077 && : >"$dir/server.properties")
    if [[ "$SECURITY" == sasl ]]; then
      cat >"$dir/server.properties" <<EOF
# Generated by deploy/kafka/kafka.sh (KAFKA_SECURITY=sasl); edits are overwritten on the next start.
listeners=CLIENT://$(host_of "$id"):$(client_port "$id"),CONTROLLER://$(host_of "$id"):$(controller_port "$id")
advertised.listeners=CLIENT://$(host_of "$id"):$(client_port "$id")
listener.security.protocol.map=CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT
inter.broker.listener.name=CLIENT
controller.listener.names=CONTROLLER
sasl.enabled.mechanisms=SCRAM-SHA-256
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256
listener.name.client.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$ADMIN_PASSWORD";
# SCRAM credentials live in the metadata log, which controllers need before they can read it: PLAIN there.
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="$ADMIN_PASSWORD" user_admin="$ADMIN_PASSWORD";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin
allow.everyone.if.no.acl.found=false
EOF
    else
      cat >"$dir/server.properties" <<EOF
# Generated by deploy/kafka/kafka.sh; edits are overwritten on the next start.
listeners=PLAINTEXT://$(host_of "$id"):$(client_port "$id"),CONTROLLER://$(host_of "$id"):$(controller_port "$id")
advertised.listeners=PLAINTEXT://$(host_of "$id"):$(client_port "$id")
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
EOF
    fi
    cat >>"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$id
controller.quorum.voters=$voters
log.dirs=$dir/log
# dagfold creates every topic explicitly (producing to a missing topic is an error).
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
share.coordinator.state.topic.num.partitions=8
# Share groups (KIP-932) carry dispatch queues. dagfold sets each group's lock duration
# (share.record.lock.duration.ms, Config.dispatch_lock_ms); tests use locks of a second or two.
group.share.min.record.lock.duration.ms=1000
group.share.max.record.lock.duration.ms=3600000
# A new member gets its share of partitions within a second (Kafka's default heartbeat is 5 s).
group.share.min.heartbeat.interval.ms=500
group.share.heartbeat.interval.ms=1000
group.initial.rebalance.delay.ms=0
# Light: a dev box with 2 cores.
num.network.threads=2
num.io.threads=2
background.threads=2
num.recovery.threads.per.data.dir=1
log.cleaner.threads=1
log.cleaner.dedupe.buffer.size=16777216
log.segment.bytes=67108864
EOF
  done
}

# -- processes -----------------------------------------------------------------
# A pid counts only while it is a Kafka started with this node's config (pids get reused).
node_pid() {
  local pidfile
  pidfile="$(node_dir "$1")/kafka.pid"
  [[ -f "$pidfile" ]] || return 1
  local pid
  pid="$(cat "$pidfile")"
  [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "kafka.Kafka $(node_dir "$1")/server.properties" || return 1
  echo "$pid"
}

# Whether PID is a live process (a zombie, exited but not yet reaped by this shell, is not).
process_running() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [[ -n "$stat" && "${stat%% *}" != Z ]]
}

port_open() { (exec 3<>"/dev/tcp/$(host_of "$1")/$(client_port "$1")") 2>/dev/null; }  # broker $1's client port

# Ready = every broker is in the cluster metadata (registered and unfenced).
brokers_ready() {
  local py="$ROOT/.venv/bin/python"
  if [[ -x "$py" ]] && "$py" -c "import confluent_kafka" 2>/dev/null; then
    KAFKA_SECURITY="$SECURITY" KAFKA_ADMIN_PASSWORD="$ADMIN_PASSWORD" \
      "$py" - "$(bootstrap)" "$BROKERS" <<'EOF' 2>/dev/null
import os, sys
from confluent_kafka.admin import AdminClient
conf = {"bootstrap.servers": sys.argv[1], "log_level": 0}
if os.environ.get("KAFKA_SECURITY") == "sasl":
    conf.update({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                 "sasl.username": "admin", "sasl.password": os.environ["KAFKA_ADMIN_PASSWORD"]})
md = AdminClient(conf).list_topics(timeout=3)
sys.exit(0 if len(md.brokers) >= int(sys.argv[2]) else 1)
EOF
  else
    local n auth=()
    [[ "$SECURITY" == sasl ]] && auth=(--command-config "$DATA/admin-client.properties")
    n="$(java -cp "$LIBS/*" org.apache.kafka.tools.BrokerApiVersionsCommand \
          --bootstrap-server "$(bootstrap)" "${auth[@]}" 2>/dev/null | grep -c '(id:' || true)"
    ((n >= BROKERS))
  fi
}

log_tail() {
  local id
  for id in $(node_ids); do
    echo "--- $(node_dir "$id")/kafka.log (last 40 lines) ---" >&2
    tail -n 40 "$(node_dir "$id")/kafka.log" >&2 2>/dev/null || true
  done
}

start() {
  fetch
  command -v java >/dev/null || die "java not found: Kafka $(grep -o '<kafka.version>[^<]*' "$POM" | cut -d'>' -f2) needs Java 17+"
  local id dir all_running=1
  for id in $(node_ids); do node_pid "$id" >/dev/null || all_running=0; done
  if ((all_running)) && brokers_ready; then
    echo "kafka.sh: already running on $(bootstrap)"
    return 0
  fi
  for id in $(node_ids); do
    if ! node_pid "$id" >/dev/null && port_open "$id"; then
      die "port $(client_port "$id") is taken by another process (set KAFKA_PORT)"
    fi
  done
  check_logging_binding
  write_configs
  if [[ ! -f "$DATA/cluster.id" ]]; then
    local out
    out="$(kafka_java kafka.tools.StorageTool random-uuid 2>"$DATA/uuid.err")" ||
      die "cannot generate a cluster id: $out $(cat "$DATA/uuid.err")"
    [[ "$out" =~ ^[A-Za-z0-9_-]{22}$ ]] || die "unexpected cluster id '$out': $(cat "$DATA/uuid.err")"
    echo "$out" >"$DATA/cluster.id"
    rm -f "$DATA/uuid.err"
  fi
  local cid
  cid="$(cat "$DATA/cluster.id")"
  for id in $(node_ids); do
    dir="$(node_dir "$id")"
    if [[ ! -f "$dir/log/meta.properties" ]]; then
      local scram=()
      [[ "$SECURITY" == sasl ]] && scram=(--add-scram "SCRAM-SHA-256=[name=admin,password=$ADMIN_PASSWORD]")
      kafka_java kafka.tools.StorageTool format -t "$cid" -c "$dir/server.properties" "${scram[@]}" \
        >"$dir/format.log" 2>&1 || { cat "$dir/format.log" >&2; die "formatting $dir failed"; }
    fi
  done
  local launched=()  # "id:pid" of the brokers this call starts
  for id in $(node_ids); do
    node_pid "$id" >/dev/null && continue
    dir="$(node_dir "$id")"
    # setsid: the broker outlives this script and ignores the terminal's Ctrl-C; `stop` ends it.
    # shellcheck disable=SC2046  # netns_of: "ip netns exec NS" or nothing (both exec: $! stays the JVM)
    KAFKA_LOG4J_OPTS="" setsid nohup $(netns_of "$id") java $HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
      -Djava.awt.headless=true \
      -Dlog4j2.configurationFile="$DATA/log4j2.properties" \
      -Dlog4j.configuration="file:$DATA/log4j.properties" \
      -cp "$LIBS/*" kafka.Kafka "$dir/server.properties" \
      >"$dir/kafka.log" 2>&1 </dev/null &
    echo $! >"$dir/kafka.pid"
    launched+=("$id:$!")
  done
  local deadline=$((SECONDS + START_TIMEOUT)) entry
  while ((SECONDS < deadline)); do
    # A broker just launched is watched by its pid, not by node_pid's command line: until the forked
    # shell has exec'd java (its redirections first, slow on a loaded machine) the command line is
    # still this script's, and that is no exit.
    for entry in "${launched[@]}"; do
      if ! process_running "${entry#*:}"; then
        log_tail
        die "broker ${entry%%:*} exited during startup (see $(node_dir "${entry%%:*}")/kafka.log)"
      fi
    done
    if port_open 1 && brokers_ready; then
      echo "kafka.sh: ready on $(bootstrap) (data $DATA)"
      return 0
    fi
    sleep 0.5
  done
  log_tail
  stop >/dev/null 2>&1 || true
  die "brokers not ready after ${START_TIMEOUT}s on $(bootstrap)"
}

stop() {
  local id pid pids=()
  for id in $(node_ids); do
    if pid="$(node_pid "$id")"; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  local deadline=$((SECONDS + 30))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "kafka.sh: pid $pid ignored SIGTERM for 30s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  for id in $(node_ids); do rm -f "$(node_dir "$id")/kafka.pid"; done
  ((${#pids[@]})) && echo "kafka.sh: stopped" || echo "kafka.sh: not running"
}

status() {
  local id pid rc=0
  for id in $(node_ids); do
    if pid="$(node_pid "$id")"; then
      echo "broker $id: running (pid $pid) on $(host_of "$id"):$(client_port "$id")"
    else
      echo "broker $id: stopped"
      rc=3
    fi
  done
  return $rc
}

case "${1:-}" in
  fetch) fetch ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  bootstrap) bootstrap ;;
  *) echo "usage: $0 fetch|start|stop|status|bootstrap" >&2; exit 2 ;;
esac
