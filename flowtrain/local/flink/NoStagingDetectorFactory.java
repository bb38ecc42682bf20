package dev.flowtrain.flink;

import java.util.Collections;
import org.apache.beam.sdk.util.construction.resources.PipelineResourcesDetector;

/**
 * Stages no jars with a Beam job: flowtrain's local Flink TaskManagers already run with the
 * Beam runner's classpath, so uploading it again (about 150 MiB per job) only costs time.
 * Chosen per job with --pipeline_resources_detector_factory_class; never for other clusters.
 */
public class NoStagingDetectorFactory implements PipelineResourcesDetector.Factory {
  public static NoStagingDetectorFactory create() {
    return new NoStagingDetectorFactory();
  }

  @Override
  public PipelineResourcesDetector getPipelineResourcesDetector() {
    return classLoader -> Collections.emptyList();
  }
}
