#!/usr/bin/env bash
# Starts the real services the tests need on loopback, without Docker:
#   Postgres (Debian packages), Redis (Debian redis-server) and Apache Kafka in
#   KRaft mode (broker+controller in one JVM, jars from Maven Central).
# NATS is not started here: the tests embed github.com/nats-io/nats-server/v2.
#
# Usage: scripts/services.sh up|down|status|check
#   up      start (or reuse) the services and write .services.env at the repo root
#   down    stop what `up` started (pid files only), remove the state dir and env file
#   status  show what is running
#   check   Kafka round trip: create a topic, transactional produce, read_committed consume
#
# Environment:
#   SERVICES                 comma list, subset of postgres,redis,kafka (default: all)
#   JUSTONCE_SERVICES_DIR    state dir (default /tmp/justonce-services)
#   JUSTONCE_CACHE           download cache (default $HOME/.cache/justonce)
#   JUSTONCE_ENV_FILE        env file to write (default <repo>/.services.env)
#   JUSTONCE_PG_PORT         default 55432
#   JUSTONCE_REDIS_PORT      default 56379
#   JUSTONCE_KAFKA_PORT      default 59092 (controller: JUSTONCE_KAFKA_CONTROLLER_PORT, default 59093)
#   JUSTONCE_PG_BIN          Postgres bin dir (default: highest /usr/lib/postgresql/*/bin)
#   KAFKA_VERSION            org.apache.kafka:kafka_2.13 version (default 4.1.2)
#   KAFKA_HEAP               JVM heap flags for the broker (default -Xms256m -Xmx512m)
#   JUSTONCE_WAIT_SECONDS    readiness deadline per service (default 120)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${JUSTONCE_SERVICES_DIR:-/tmp/justonce-services}
CACHE=${JUSTONCE_CACHE:-$HOME/.cache/justonce}
ENV_FILE=${JUSTONCE_ENV_FILE:-$ROOT/.services.env}
SERVICES=${SERVICES:-postgres,redis,kafka}

PG_PORT=${JUSTONCE_PG_PORT:-55432}
REDIS_PORT=${JUSTONCE_REDIS_PORT:-56379}
KAFKA_PORT=${JUSTONCE_KAFKA_PORT:-59092}
KAFKA_CONTROLLER_PORT=${JUSTONCE_KAFKA_CONTROLLER_PORT:-59093}
KAFKA_VERSION=${KAFKA_VERSION:-4.1.2}
LOG4J_VERSION=${LOG4J_VERSION:-2.24.3}
KAFKA_HEAP=${KAFKA_HEAP:--Xms256m -Xmx512m}
WAIT_SECONDS=${JUSTONCE_WAIT_SECONDS:-120}

PG_DIR=$STATE/pg
PG_DATA=$PG_DIR/data
REDIS_DIR=$STATE/redis
KAFKA_DIR=$STATE/kafka
KAFKA_HOME=$CACHE/kafka-$KAFKA_VERSION
JAVA=${JAVA_HOME:+$JAVA_HOME/bin/}java
JAVAC=${JAVA_HOME:+$JAVA_HOME/bin/}javac

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.1fs", e - s }'; }

want() { [[ ",$SERVICES," == *",$1,"* ]]; }
port_for() {
  case $1 in
    postgres) echo "$PG_PORT" ;;
    redis) echo "$REDIS_PORT" ;;
    kafka) echo "$KAFKA_PORT" ;;
  esac
}

for s in ${SERVICES//,/ }; do
  case $s in postgres | redis | kafka) ;; *) die "unknown service '$s' in SERVICES (want postgres,redis,kafka)" ;; esac
done

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# pid_alive PIDFILE PATTERN: the pid in the file is running and its command line
# contains PATTERN (guards against a recycled pid).
pid_alive() {
  local f=$1 pat=$2 pid
  [[ -s $f ]] || return 1
  pid=$(head -n1 "$f" | tr -dc 0-9)
  live "$pid" || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$pat"
}
# live PID: running and not a zombie (PID 1 on some CI VMs reaps orphans late).
live() {
  [[ -n $1 ]] && kill -0 "$1" 2>/dev/null || return 1
  ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}
pid_of() { head -n1 "$1" | tr -dc 0-9; }

show_log() {
  local f=$1
  if [[ -f $f ]]; then
    printf '[services] ---- last lines of %s ----\n' "$f" >&2
    tail -n 40 "$f" >&2 || true
    printf '[services] ----\n' >&2
  else
    log "(no log at $f)"
  fi
}

# stop_pid PIDFILE PATTERN SIGNAL NAME: signal our process and wait for it to exit.
stop_pid() {
  local f=$1 pat=$2 sig=$3 name=$4 pid i
  pid_alive "$f" "$pat" || return 0
  pid=$(pid_of "$f")
  log "stopping $name (pid $pid)"
  kill "-$sig" "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    live "$pid" || return 0
    sleep 0.1
  done
  log "$name did not stop in 30s, sending KILL"
  kill -KILL "$pid" 2>/dev/null || true
  sleep 0.5
}

# ---------------------------------------------------------------- Postgres

pg_bin() {
  if [[ -n ${JUSTONCE_PG_BIN:-} ]]; then
    echo "$JUSTONCE_PG_BIN"
    return
  fi
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
  [[ -n $d && -x $d/initdb ]] || die "no Postgres server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)"
  echo "$d"
}

# Run a command as the postgres user when we are root (initdb/postgres refuse root).
as_pg() {
  local cmd
  cmd=$(printf '%q ' "$@")
  if [[ $(id -u) -eq 0 ]]; then
    su postgres -s /bin/bash -c "$cmd"
  else
    bash -c "$cmd"
  fi
}

pg_running() { pid_alive "$PG_DATA/postmaster.pid" postgres; }
pg_ready() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -t 2; }

pg_start() {
  PG_BIN=$(pg_bin)
  if pg_running; then
    pg_ready || die "our Postgres (pid $(pid_of "$PG_DATA/postmaster.pid")) runs but does not answer on port $PG_PORT; run '$0 down' first"
    log "postgres: reusing running server (pid $(pid_of "$PG_DATA/postmaster.pid"))"
    return
  fi
  if port_open "$PG_PORT"; then
    die "port $PG_PORT is taken by a process this script did not start (set JUSTONCE_PG_PORT)"
  fi
  mkdir -p "$PG_DIR"
  if [[ $(id -u) -eq 0 ]]; then chown postgres: "$PG_DIR"; fi
  if [[ ! -f $PG_DATA/PG_VERSION ]]; then
    rm -rf "$PG_DATA"
    as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U postgres -A trust -E UTF8 --no-locale --no-sync >"$PG_DIR/initdb.log" 2>&1 ||
      { show_log "$PG_DIR/initdb.log"; die "initdb failed"; }
    echo "include 'justonce.conf'" >>"$PG_DATA/postgresql.conf"
  fi
  pg_clear_stale_pid
  cat >"$PG_DATA/justonce.conf" <<EOF
# written by scripts/services.sh on every start
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DIR'
max_connections = 400
shared_buffers = 256MB
fsync = on
logging_collector = off
EOF
  if [[ $(id -u) -eq 0 ]]; then chown postgres: "$PG_DATA/justonce.conf"; fi
  rm -f "$PG_DIR/postgres.log"
  log "postgres: starting ($PG_BIN, port $PG_PORT)"
  as_pg setsid -w "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DIR/postgres.log" -w -t "$WAIT_SECONDS" start >/dev/null 2>&1 9>&- ||
    { show_log "$PG_DIR/postgres.log"; die "postgres did not start (pg_ctl start failed)"; }
}

# A postmaster that died uncleanly (kill -9, OOM) leaves postmaster.pid and the
# socket lock file behind; if its pid is now a zombie that PID 1 has not reaped yet,
# postgres takes it for a live server and refuses to start. Once no live process
# works in the data dir (every backend chdirs there), those files are stale and
# safe to remove.
pg_clear_stale_pid() {
  compgen -G "$PG_DATA/postmaster.pid" >/dev/null || compgen -G "$PG_DIR/.s.PGSQL.*" >/dev/null || return 0
  local i p busy
  for ((i = 0; i < 100; i++)); do
    busy=
    for p in /proc/[0-9]*; do
      [[ $(readlink "$p/cwd" 2>/dev/null) == "$PG_DATA" ]] && live "${p#/proc/}" && busy=1 && break
    done
    [[ -z $busy ]] && break
    sleep 0.1
  done
  if [[ -n $busy ]]; then
    die "a stale Postgres process still works in $PG_DATA (pid ${p#/proc/}); run '$0 down' first"
  fi
  log "postgres: removing stale postmaster.pid / socket lock (previous server died)"
  rm -f "$PG_DATA/postmaster.pid" "$PG_DIR"/.s.PGSQL.*
}

pg_wait() {
  local deadline=$(($(date +%s) + WAIT_SECONDS))
  until pg_ready; do
    if (($(date +%s) > deadline)); then
      show_log "$PG_DIR/postgres.log"
      die "postgres did not answer on 127.0.0.1:$PG_PORT within ${WAIT_SECONDS}s"
    fi
    if ! pg_running; then
      show_log "$PG_DIR/postgres.log"
      die "postgres exited"
    fi
    sleep 0.1
  done
}

pg_stop() {
  if pg_running; then
    log "stopping postgres (pid $(pid_of "$PG_DATA/postmaster.pid"))"
    PG_BIN=$(pg_bin)
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 30 stop >/dev/null 2>&1 ||
      stop_pid "$PG_DATA/postmaster.pid" postgres QUIT postgres
  fi
}

# ---------------------------------------------------------------- Redis

redis_running() { pid_alive "$REDIS_DIR/redis.pid" redis-server; }
redis_ready() { [[ $(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]; }

redis_start() {
  command -v redis-server >/dev/null || die "redis-server not found (apt-get install redis-server)"
  if redis_running; then
    redis_ready || die "our redis-server (pid $(pid_of "$REDIS_DIR/redis.pid")) runs but does not answer on port $REDIS_PORT; run '$0 down' first"
    log "redis: reusing running server (pid $(pid_of "$REDIS_DIR/redis.pid"))"
    return
  fi
  if port_open "$REDIS_PORT"; then
    die "port $REDIS_PORT is taken by a process this script did not start (set JUSTONCE_REDIS_PORT)"
  fi
  mkdir -p "$REDIS_DIR"
  rm -f "$REDIS_DIR/redis.log" "$REDIS_DIR/redis.pid"
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no \
    --daemonize yes --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log" \
    --dir "$REDIS_DIR" </dev/null >/dev/null 2>&1 9>&- ||
    { show_log "$REDIS_DIR/redis.log"; die "redis-server failed to start"; }
  log "redis: starting (port $REDIS_PORT)"
}

redis_wait() {
  local deadline=$(($(date +%s) + WAIT_SECONDS))
  until redis_ready; do
    if (($(date +%s) > deadline)); then
      show_log "$REDIS_DIR/redis.log"
      die "redis did not answer on 127.0.0.1:$REDIS_PORT within ${WAIT_SECONDS}s"
    fi
    sleep 0.05
  done
}

redis_stop() {
  stop_pid "$REDIS_DIR/redis.pid" redis-server TERM redis
}

# ---------------------------------------------------------------- Kafka

kafka_running() { pid_alive "$KAFKA_DIR/kafka.pid" kafka.Kafka; }

# Resolve kafka_2.13 and its runtime dependencies from Maven Central into
# $KAFKA_HOME/libs (once per version), plus a log4j2 backend, and compile the
# small AdminClient probe used for the readiness check.
kafka_fetch() {
  command -v "$JAVA" >/dev/null || die "java not found (need Java 17)"
  mkdir -p "$KAFKA_HOME"
  if [[ ! -f $KAFKA_HOME/libs/.complete ]]; then
    command -v mvn >/dev/null || die "mvn not found (needed once to fetch Kafka $KAFKA_VERSION jars)"
    local t0
    t0=$(now)
    log "kafka: resolving org.apache.kafka:kafka_2.13:$KAFKA_VERSION from Maven Central into $KAFKA_HOME/libs"
    cat >"$KAFKA_HOME/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- generated by justonce scripts/services.sh: Kafka broker jars for local tests -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.justonce</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <!-- kafka_2.13 only depends on slf4j-api; route it to log4j2 -->
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
    rm -rf "$KAFKA_HOME/libs.tmp"
    # (Debian's Maven 3.8 prints bare ANSI resets even with -q -B: strip them.)
    (cd "$KAFKA_HOME" && mvn -q -B -ntp -Dstyle.color=never dependency:copy-dependencies \
      -DoutputDirectory=libs.tmp -DincludeScope=runtime </dev/null 2>&1) | sed -e 's/\x1b\[[0-9;]*m//g' -e '/^[[:space:]]*$/d' >&2 ||
      die "maven could not fetch Kafka $KAFKA_VERSION (see output above)"
    rm -rf "$KAFKA_HOME/libs"
    mv "$KAFKA_HOME/libs.tmp" "$KAFKA_HOME/libs"
    touch "$KAFKA_HOME/libs/.complete"
    log "kafka: $(ls "$KAFKA_HOME"/libs/*.jar | wc -l) jars fetched in $(elapsed "$t0")"
  fi

  cat >"$KAFKA_HOME/log4j2.xml.tmp" <<'EOF'
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="kafka.server.KafkaRaftServer" level="${sys:justonce.kafka.startlog:-INFO}"/>
    <Logger name="kafka.server.BrokerServer" level="${sys:justonce.kafka.startlog:-INFO}"/>
    <Logger name="org.apache.kafka.common.utils.AppInfoParser" level="${sys:justonce.kafka.startlog:-INFO}"/>
    <Root level="${sys:justonce.kafka.loglevel:-WARN}">
      <AppenderRef ref="STDOUT"/>
    </Root>
  </Loggers>
</Configuration>
EOF
  mv "$KAFKA_HOME/log4j2.xml.tmp" "$KAFKA_HOME/log4j2.xml"

  kafka_probe_source >"$KAFKA_HOME/JustonceKafkaProbe.java.new"
  if ! cmp -s "$KAFKA_HOME/JustonceKafkaProbe.java.new" "$KAFKA_HOME/JustonceKafkaProbe.java" ||
    [[ ! -f $KAFKA_HOME/probe/JustonceKafkaProbe.class ]]; then
    mv "$KAFKA_HOME/JustonceKafkaProbe.java.new" "$KAFKA_HOME/JustonceKafkaProbe.java"
    rm -rf "$KAFKA_HOME/probe"
    "$JAVAC" -nowarn -d "$KAFKA_HOME/probe" -cp "$KAFKA_HOME/libs/*" "$KAFKA_HOME/JustonceKafkaProbe.java" ||
      die "could not compile the Kafka probe"
  else
    rm -f "$KAFKA_HOME/JustonceKafkaProbe.java.new"
  fi
}

kafka_probe_source() {
  cat <<'EOF'
import java.time.Duration;
import java.util.*;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.clients.consumer.*;
import org.apache.kafka.clients.producer.*;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.serialization.*;

// Readiness probe (and optional round trip) used by scripts/services.sh.
public class JustonceKafkaProbe {
  public static void main(String[] args) throws Exception {
    String bootstrap = args[0];
    long deadline = System.currentTimeMillis() + Long.parseLong(args[1]) * 1000L;
    boolean roundTrip = args.length > 2 && args[2].equals("roundtrip");
    Properties p = new Properties();
    p.put("bootstrap.servers", bootstrap);
    p.put("request.timeout.ms", "3000");
    p.put("default.api.timeout.ms", "5000");
    p.put("reconnect.backoff.max.ms", "250");
    Exception last = null;
    try (Admin admin = Admin.create(p)) {
      while (true) {
        try {
          Collection<Node> nodes = admin.describeCluster().nodes().get(5, TimeUnit.SECONDS);
          String controller = String.valueOf(admin.describeCluster().controller().get(5, TimeUnit.SECONDS));
          Set<String> topics = admin.listTopics().names().get(5, TimeUnit.SECONDS);
          if (!nodes.isEmpty()) {
            System.out.println("kafka ready: brokers=" + nodes + " controller=" + controller + " topics=" + topics.size());
            break;
          }
        } catch (Exception e) {
          last = e;
        }
        if (System.currentTimeMillis() > deadline) {
          System.err.println("kafka not ready: " + last);
          System.exit(1);
        }
        Thread.sleep(200);
      }
      if (!roundTrip) return;

      String topic = "justonce-check-" + System.currentTimeMillis();
      admin.createTopics(List.of(new NewTopic(topic, 2, (short) 1))).all().get(30, TimeUnit.SECONDS);
      System.out.println("created topic " + topic);

      Properties pp = new Properties();
      pp.put("bootstrap.servers", bootstrap);
      pp.put("transactional.id", topic + "-tx");
      pp.put("enable.idempotence", "true");
      pp.put("acks", "all");
      try (KafkaProducer<String, String> prod = new KafkaProducer<>(pp, new StringSerializer(), new StringSerializer())) {
        prod.initTransactions();
        prod.beginTransaction();
        prod.send(new ProducerRecord<>(topic, "k", "aborted"));
        prod.abortTransaction();
        prod.beginTransaction();
        for (int i = 0; i < 3; i++) prod.send(new ProducerRecord<>(topic, "k", "committed-" + i));
        prod.commitTransaction();
      }
      System.out.println("transactional produce ok");

      Properties cp = new Properties();
      cp.put("bootstrap.servers", bootstrap);
      cp.put("group.id", topic + "-group");
      cp.put("auto.offset.reset", "earliest");
      cp.put("isolation.level", "read_committed");
      cp.put("enable.auto.commit", "false");
      List<String> got = new ArrayList<>();
      try (KafkaConsumer<String, String> cons = new KafkaConsumer<>(cp, new StringDeserializer(), new StringDeserializer())) {
        cons.subscribe(List.of(topic));
        long end = System.currentTimeMillis() + 30000;
        while (got.size() < 3 && System.currentTimeMillis() < end) {
          for (ConsumerRecord<String, String> r : cons.poll(Duration.ofMillis(500))) got.add(r.value());
        }
        cons.commitSync();
      }
      System.out.println("read_committed consume got " + got);
      if (!got.equals(List.of("committed-0", "committed-1", "committed-2"))) {
        System.err.println("unexpected records: " + got);
        System.exit(1);
      }
      admin.deleteTopics(List.of(topic)).all().get(30, TimeUnit.SECONDS);
      System.out.println("kafka round trip ok");
    }
  }
}
EOF
}

kafka_probe() { # kafka_probe SECONDS [roundtrip]
  "$JAVA" -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
    -Dlog4j2.configurationFile="$KAFKA_HOME/log4j2.xml" -Djustonce.kafka.loglevel=ERROR -Djustonce.kafka.startlog=ERROR \
    -cp "$KAFKA_HOME/probe:$KAFKA_HOME/libs/*" JustonceKafkaProbe "127.0.0.1:$KAFKA_PORT" "$@"
}

kafka_start() {
  kafka_fetch
  if kafka_running; then
    kafka_probe 10 >/dev/null 2>&1 ||
      die "our Kafka (pid $(pid_of "$KAFKA_DIR/kafka.pid")) runs but does not answer on port $KAFKA_PORT; run '$0 down' first"
    log "kafka: reusing running broker (pid $(pid_of "$KAFKA_DIR/kafka.pid"))"
    KAFKA_REUSED=1
    return
  fi
  local p
  for p in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
    if port_open "$p"; then
      die "port $p is taken by a process this script did not start (set JUSTONCE_KAFKA_PORT / JUSTONCE_KAFKA_CONTROLLER_PORT)"
    fi
  done
  mkdir -p "$KAFKA_DIR"
  cat >"$KAFKA_DIR/server.properties" <<EOF
# written by scripts/services.sh: single-node KRaft (broker + controller)
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=4
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
EOF
  local jopts=(-Dlog4j2.configurationFile="$KAFKA_HOME/log4j2.xml" -Djava.awt.headless=true)
  if [[ ! -f $KAFKA_DIR/data/meta.properties ]]; then
    local cid
    # A cluster id that starts with '-' reads as an option to the tool
    # (Kafka's own random ids avoid it too): draw again.
    cid=-
    while [[ $cid == -* ]]; do cid=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '='); done
    "$JAVA" -Xmx256m -XX:TieredStopAtLevel=1 "${jopts[@]}" -Djustonce.kafka.startlog=WARN -cp "$KAFKA_HOME/libs/*" \
      kafka.tools.StorageTool format -t "$cid" -c "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/format.log" 2>&1 ||
      { show_log "$KAFKA_DIR/format.log"; die "kafka storage format failed"; }
  fi
  rm -f "$KAFKA_DIR/kafka.log"
  # shellcheck disable=SC2086 # KAFKA_HEAP is a list of flags
  setsid nohup "$JAVA" -server $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 "${jopts[@]}" \
    -cp "$KAFKA_HOME/libs/*" kafka.Kafka "$KAFKA_DIR/server.properties" \
    </dev/null >"$KAFKA_DIR/kafka.log" 2>&1 9>&- &
  echo $! >"$KAFKA_DIR/kafka.pid"
  log "kafka: starting $KAFKA_VERSION (pid $!, port $KAFKA_PORT, controller $KAFKA_CONTROLLER_PORT)"
}

kafka_wait() {
  [[ -n ${KAFKA_REUSED:-} ]] && return
  local deadline=$(($(date +%s) + WAIT_SECONDS)) left
  until port_open "$KAFKA_PORT"; do
    if ! kafka_running; then
      show_log "$KAFKA_DIR/kafka.log"
      die "kafka exited during startup"
    fi
    if (($(date +%s) > deadline)); then
      show_log "$KAFKA_DIR/kafka.log"
      die "kafka did not listen on 127.0.0.1:$KAFKA_PORT within ${WAIT_SECONDS}s"
    fi
    sleep 0.2
  done
  left=$((deadline - $(date +%s)))
  ((left < 10)) && left=10
  if ! kafka_probe "$left" >"$KAFKA_DIR/probe.log" 2>&1; then
    show_log "$KAFKA_DIR/probe.log"
    show_log "$KAFKA_DIR/kafka.log"
    die "kafka did not answer a metadata request on 127.0.0.1:$KAFKA_PORT"
  fi
}

kafka_stop() {
  stop_pid "$KAFKA_DIR/kafka.pid" kafka.Kafka TERM kafka
}

# ---------------------------------------------------------------- env file

write_env() {
  local tmp=$ENV_FILE.tmp.$$ any=
  : >"$tmp"
  if pg_running; then
    echo "JUSTONCE_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable" >>"$tmp"
    any=1
  fi
  if redis_running; then
    echo "JUSTONCE_TEST_REDIS_ADDR=127.0.0.1:$REDIS_PORT" >>"$tmp"
    any=1
  fi
  if kafka_running; then
    echo "JUSTONCE_TEST_KAFKA_BROKERS=127.0.0.1:$KAFKA_PORT" >>"$tmp"
    any=1
  fi
  if [[ -n $any ]]; then
    mv "$tmp" "$ENV_FILE"
  else
    rm -f "$tmp" "$ENV_FILE"
  fi
}

# ---------------------------------------------------------------- commands

# One services.sh at a time per cache dir (also guards the Maven fetch).
lock() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/services.lock"
  flock -w 600 9 || die "another services.sh holds $CACHE/services.lock"
}

cmd_up() {
  local t0 s
  t0=$(now)
  lock
  mkdir -p "$STATE"
  chmod 755 "$STATE"
  # Kafka's JVM is the slow one: start it first, then the others while it boots.
  if want kafka; then kafka_start; fi
  if want postgres; then pg_start; fi
  if want redis; then redis_start; fi
  for s in postgres redis kafka; do
    want "$s" || continue
    case $s in
      postgres) pg_wait ;;
      redis) redis_wait ;;
      kafka) kafka_wait ;;
    esac
    log "$s: ready on 127.0.0.1:$(port_for "$s") ($(elapsed "$t0") since up)"
  done
  write_env
  log "nats: not started here; the tests embed github.com/nats-io/nats-server/v2"
  log "wrote $ENV_FILE:"
  sed 's/^/[services]   /' "$ENV_FILE" >&2
  log "up done in $(elapsed "$t0")"
}

cmd_down() {
  lock
  if want kafka; then kafka_stop; fi
  if want redis; then redis_stop; fi
  if want postgres; then pg_stop; fi
  if pg_running || redis_running || kafka_running; then
    write_env
    log "some services are still running (not in SERVICES=$SERVICES); kept $STATE"
  else
    rm -rf "$STATE"
    rm -f "$ENV_FILE"
    log "down: removed $STATE and $ENV_FILE"
  fi
}

cmd_status() {
  local rc=0
  if pg_running; then
    PG_BIN=$(pg_bin)
    if pg_ready; then echo "postgres: running (pid $(pid_of "$PG_DATA/postmaster.pid")), answers on 127.0.0.1:$PG_PORT"; else echo "postgres: running but NOT answering on 127.0.0.1:$PG_PORT"; rc=1; fi
  else
    echo "postgres: stopped"
  fi
  if redis_running; then
    if redis_ready; then echo "redis: running (pid $(pid_of "$REDIS_DIR/redis.pid")), answers on 127.0.0.1:$REDIS_PORT"; else echo "redis: running but NOT answering on 127.0.0.1:$REDIS_PORT"; rc=1; fi
  else
    echo "redis: stopped"
  fi
  if kafka_running; then
    if port_open "$KAFKA_PORT"; then echo "kafka: running (pid $(pid_of "$KAFKA_DIR/kafka.pid")), listening on 127.0.0.1:$KAFKA_PORT"; else echo "kafka: running but NOT listening on 127.0.0.1:$KAFKA_PORT"; rc=1; fi
  else
    echo "kafka: stopped"
  fi
  echo "nats: embedded in the tests (not managed here)"
  if [[ -f $ENV_FILE ]]; then
    echo "env file $ENV_FILE:"
    sed 's/^/  /' "$ENV_FILE"
  else
    echo "env file $ENV_FILE: absent"
  fi
  return $rc
}

cmd_check() {
  kafka_running || die "kafka is not running (run '$0 up')"
  kafka_fetch
  kafka_probe 30 roundtrip
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  check) cmd_check ;;
  *)
    echo "usage: $0 up|down|status|check   (SERVICES=postgres,redis,kafka)" >&2
    exit 2
    ;;
esac
