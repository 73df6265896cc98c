# A SPOT fleet of BOINC hosts: instance template (SPOT, termination action) and managed
# instance group, optionally an on-demand twin for the controller's fallback.

locals {
  labels      = merge({ "boinc-dl-role" = "host", "boinc-dl-fleet" = var.name }, var.labels)
  requirement = coalesce(var.boinc_dl_requirement, "boinc-dl[${var.variant}]")
  role_prefix = replace(var.name, "-", "_")
  user_data = templatefile("${path.module}/../../cloud-init/host.yaml.tftpl", {
    cloud       = "gcp"
    region      = ""
    project_url = var.project_url
    secret_id   = var.weak_key_secret_id
    requirement = local.requirement
  })
  markets = merge(
    { spot = { name = var.name, provisioning = "SPOT" } },
    var.on_demand_name == null ? {} : { on_demand = { name = var.on_demand_name, provisioning = "STANDARD" } },
  )
}

# --- hosts' identity: read the weak key, nothing else ----------------------------------

resource "google_service_account" "host" {
  project      = var.project
  account_id   = "${var.name}-host"
  display_name = "boinc-dl ${var.name} hosts (read the weak account key)"
}

resource "google_secret_manager_secret_iam_member" "host" {
  secret_id = var.weak_key_secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.host.email}"
}

# --- templates and groups -------------------------------------------------------------

resource "google_compute_instance_template" "this" {
  #checkov:skip=CKV_GCP_40: hosts have no inbound rule at all; the ephemeral address is their way out to the project and package index without a Cloud NAT
  for_each     = local.markets
  project      = var.project
  name_prefix  = "${each.value.name}-"
  description  = "boinc-dl ${var.variant} host (${each.value.provisioning})"
  machine_type = var.machine_type
  labels       = local.labels

  disk {
    source_image = var.image
    disk_size_gb = var.boot_disk_gb
    disk_type    = "pd-balanced"
    boot         = true
    auto_delete  = true
    dynamic "disk_encryption_key" {
      for_each = var.kms_key_self_link == null ? [] : [var.kms_key_self_link]
      content {
        kms_key_self_link = disk_encryption_key.value
      }
    }
  }

  dynamic "guest_accelerator" {
    for_each = var.gpu_type == null ? [] : [var.gpu_type]
    content {
      type  = guest_accelerator.value
      count = var.gpu_count
    }
  }

  # Ephemeral external address: the way out to the project and the package index
  # (no inbound firewall rule targets the hosts).
  network_interface {
    network    = var.network
    subnetwork = var.subnetwork
    access_config {}
  }

  scheduling {
    provisioning_model          = each.value.provisioning
    preemptible                 = each.value.provisioning == "SPOT"
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE" # GPUs and SPOT VMs cannot live-migrate
    instance_termination_action = each.value.provisioning == "SPOT" ? var.termination_action : null
  }

  shielded_instance_config {
    enable_secure_boot          = var.variant == "cpu" # the NVIDIA kernel module of most images is unsigned
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  service_account {
    email  = google_service_account.host.email
    scopes = ["cloud-platform"] # access is limited by IAM: the one secret
  }

  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    user-data              = local.user_data
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_instance_group_manager" "this" {
  for_each           = local.markets
  project            = var.project
  zone               = var.zone
  name               = each.value.name
  base_instance_name = each.value.name
  target_size        = 0

  version {
    instance_template = google_compute_instance_template.this[each.key].self_link_unique
  }

  update_policy {
    type                  = "OPPORTUNISTIC" # new template on replacement, never a rolling restart of busy hosts
    minimal_action        = "REPLACE"
    max_unavailable_fixed = 1
    max_surge_fixed       = 1
  }

  # The fleet controller owns the size.
  lifecycle {
    ignore_changes = [target_size]
  }
}

# --- the fleet controller's permissions ---------------------------------------------------

resource "google_service_account" "controller" {
  project      = var.project
  account_id   = "${var.name}-ctl"
  display_name = "boinc-dl fleet controller for ${var.name}"
}

resource "google_project_iam_custom_role" "resize" {
  project     = var.project
  role_id     = "${local.role_prefix}_fleet_resize"
  title       = "boinc-dl fleet controller: resize ${var.name}"
  description = "get, resize, list and recreate the managed instances of the fleet's groups"
  permissions = [
    "compute.instanceGroupManagers.get",
    "compute.instanceGroupManagers.update",
  ]
}

resource "google_project_iam_custom_role" "observe" {
  project     = var.project
  role_id     = "${local.role_prefix}_fleet_observe"
  title       = "boinc-dl fleet controller: observe ${var.name}"
  description = "list instances and zone operations (preemptions)"
  permissions = [
    "compute.instances.list",
    "compute.instances.get",
    "compute.zoneOperations.list",
  ]
}

locals {
  controller_members = concat(["serviceAccount:${google_service_account.controller.email}"], var.controller_members)
  mig_names          = [for m in values(local.markets) : m.name]
}

# count, not for_each: the members' e-mails are only known after apply.
resource "google_project_iam_member" "resize" {
  count   = length(local.controller_members)
  project = var.project
  role    = google_project_iam_custom_role.resize.id
  member  = local.controller_members[count.index]
  # Only these groups: list calls are not narrowed by conditions, these are.
  condition {
    title      = "${var.name}-groups-only"
    expression = join(" || ", [for n in local.mig_names : "resource.name == \"projects/${var.project}/zones/${var.zone}/instanceGroupManagers/${n}\""])
  }
}

resource "google_project_iam_member" "observe" {
  count   = length(local.controller_members)
  project = var.project
  role    = google_project_iam_custom_role.observe.id
  member  = local.controller_members[count.index]
}
