package io.dagfold.example;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;
import java.util.stream.Collectors;
import java.util.stream.Stream;

import org.apache.avro.Schema;
import org.apache.avro.AvroRuntimeException;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.generic.GenericRecordBuilder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Submits dagfold jobs from Java with no dagfold code: the published {@code schemas/} folder,
 * Avro's own single-object encoder and a Kafka producer with default settings.
 *
 * <pre>
 *   java -cp "$(examples/java/build.sh)" io.dagfold.example.SubmitJobProducer \
 *       --bootstrap 127.0.0.1:9092 [--topic commands] [--schemas schemas] [--jobs 1] [--tasks 2] [--job-prefix java-]
 * </pre>
 *
 * Each job is a chain of {@code --tasks} shell tasks. The record key is the job ID and no
 * partitioner is configured, so the Java client's default (murmur2 of the key) picks the
 * partition, which is dagfold's partitioner too. Prints one line per job: its ID and the
 * partition it landed on.
 */
public final class SubmitJobProducer {
    private SubmitJobProducer() {
    }

    /**
     * Parses the SubmitJob schema with the named types it uses ({@code dagfold.common.*}).
     * A type must be parsed before a schema that names it, so files are taken in rounds until
     * every one parsed (each round with a fresh parser, so a failed attempt leaves nothing behind).
     */
    static Schema submitJobSchema(Path dir) throws IOException {
        List<Path> files;
        try (Stream<Path> s = Files.list(dir)) {
            files = s.filter(p -> {
                String n = p.getFileName().toString();
                return n.startsWith("dagfold.common.") && n.endsWith(".avsc");
            }).sorted().collect(Collectors.toCollection(ArrayList::new));
        }
        files.add(dir.resolve("dagfold.command.SubmitJob.avsc"));
        List<String> ordered = new ArrayList<>();
        List<String> pending = new ArrayList<>();
        for (Path f : files) {
            pending.add(Files.readString(f));
        }
        while (!pending.isEmpty()) {
            boolean progress = false;
            for (int i = 0; i < pending.size(); i++) {
                Schema.Parser parser = new Schema.Parser();
                try {
                    for (String done : ordered) {
                        parser.parse(done);
                    }
                    parser.parse(pending.get(i));
                } catch (AvroRuntimeException e) { // a name not defined yet (SchemaParseException, AvroTypeException)
                    continue;
                }
                ordered.add(pending.remove(i));
                progress = true;
                break;
            }
            if (!progress) {
                throw new IllegalStateException("schemas in " + dir + " name types that are not defined");
            }
        }
        Schema.Parser parser = new Schema.Parser();
        for (String done : ordered) {
            parser.parse(done);
        }
        return parser.getTypes().get("dagfold.command.SubmitJob");
    }

    static GenericRecord submission(Schema submitJob, String jobId, int tasks) {
        Schema jobSpec = submitJob.getField("spec").schema();
        Schema taskSpec = jobSpec.getField("tasks").schema().getElementType();
        List<GenericRecord> taskList = new ArrayList<>();
        for (int i = 0; i < tasks; i++) {
            List<String> deps = i == 0 ? List.of() : List.of("t" + (i - 1));
            taskList.add(new GenericRecordBuilder(taskSpec)
                    .set("task_id", "t" + i)
                    .set("handler", "sleep")
                    .set("args_json", "{\"seconds\": 0.05}")
                    .set("depends_on", new GenericData.Array<>(taskSpec.getField("depends_on").schema(), deps))
                    .build());
        }
        Map<String, String> labels = new HashMap<>();
        labels.put("source", "java-example");
        GenericRecord spec = new GenericRecordBuilder(jobSpec)
                .set("job_id", jobId)
                .set("labels", labels)
                .set("tasks", new GenericData.Array<>(jobSpec.getField("tasks").schema(), taskList))
                .build();
        return new GenericRecordBuilder(submitJob)
                .set("spec", spec)
                .set("submitted_at_ms", System.currentTimeMillis())
                .set("source", "java-example")
                .build();
    }

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = new HashMap<>(Map.of(
                "--bootstrap", "127.0.0.1:9092", "--topic", "commands", "--schemas", "schemas",
                "--jobs", "1", "--tasks", "2", "--job-prefix", "java-"));
        for (int i = 0; i + 1 < argv.length; i += 2) {
            if (!args.containsKey(argv[i])) {
                System.err.println("unknown option " + argv[i] + "; options: " + args.keySet());
                System.exit(2);
            }
            args.put(argv[i], argv[i + 1]);
        }
        Schema schema = submitJobSchema(Paths.get(args.get("--schemas")));
        // Avro's own single-object encoding: C3 01, the schema's CRC-64-AVRO fingerprint, the body.
        BinaryMessageEncoder<GenericRecord> encoder = new BinaryMessageEncoder<>(GenericData.get(), schema);

        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args.get("--bootstrap"));
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        // No partitioner.class: the default partitions a keyed record by murmur2(key), as dagfold does.
        int jobs = Integer.parseInt(args.get("--jobs"));
        int tasks = Integer.parseInt(args.get("--tasks"));
        String run = UUID.randomUUID().toString().substring(0, 8);
        try (KafkaProducer<String, byte[]> producer = new KafkaProducer<>(props)) {
            List<String> ids = new ArrayList<>();
            List<java.util.concurrent.Future<RecordMetadata>> sent = new ArrayList<>();
            for (int j = 0; j < jobs; j++) {
                String jobId = args.get("--job-prefix") + run + "-" + j;
                ByteBuffer buf = encoder.encode(submission(schema, jobId, tasks));
                byte[] value = new byte[buf.remaining()];
                buf.get(value);
                ids.add(jobId);
                sent.add(producer.send(new ProducerRecord<>(args.get("--topic"), jobId, value)));
            }
            producer.flush();
            for (int j = 0; j < jobs; j++) {
                System.out.println(ids.get(j) + " " + sent.get(j).get().partition());
            }
        }
    }
}
