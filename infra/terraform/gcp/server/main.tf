# The boinc-dl server: one shielded VM running the docker compose stack, a data disk, a
# static address, HTTP(S)-only ingress, and the stack's secrets in Secret Manager.

locals {
  labels   = merge({ "boinc-dl-role" = "server" }, var.labels)
  url_base = "http://${google_compute_address.this.address}"
}

resource "random_password" "redis" {
  length  = 40
  special = false
}

# The Redis password is generated here (so it is in the state: keep the state in an
# encrypted backend); the weak account key has no version here: the admin adds it.
resource "google_secret_manager_secret" "redis_password" {
  project   = var.project
  secret_id = "${var.name}-redis-password"
  labels    = local.labels
  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "redis_password" {
  secret      = google_secret_manager_secret.redis_password.id
  secret_data = random_password.redis.result
}

resource "google_secret_manager_secret" "weak_key" {
  project   = var.project
  secret_id = "${var.name}-weak-account-key"
  labels    = local.labels
  replication {
    auto {}
  }
}

resource "google_service_account" "server" {
  project      = var.project
  account_id   = "${var.name}-server"
  display_name = "boinc-dl server (reads its Redis password)"
}

resource "google_secret_manager_secret_iam_member" "server" {
  project   = var.project
  secret_id = google_secret_manager_secret.redis_password.secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.server.email}"
}

resource "google_compute_address" "this" {
  project = var.project
  region  = var.region
  name    = "${var.name}-server"
}

resource "google_compute_firewall" "http" {
  #checkov:skip=CKV_GCP_106: BOINC clients reach the scheduler and file servers over HTTP from anywhere; narrow http_cidrs to the fleet's ranges if no volunteer joins
  project       = var.project
  name          = "${var.name}-server-http"
  network       = var.network
  description   = "boinc-dl server: HTTP and HTTPS (scheduler, uploads, downloads, web pages)"
  direction     = "INGRESS"
  source_ranges = var.http_cidrs
  target_tags   = ["${var.name}-server"]
  allow {
    protocol = "tcp"
    ports    = ["80", "443"]
  }
}

resource "google_compute_firewall" "ssh" {
  count         = length(var.admin_ssh_cidrs) > 0 ? 1 : 0
  project       = var.project
  name          = "${var.name}-server-ssh"
  network       = var.network
  description   = "boinc-dl server: SSH from admin networks only"
  direction     = "INGRESS"
  source_ranges = var.admin_ssh_cidrs
  target_tags   = ["${var.name}-server"]
  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

resource "google_compute_disk" "data" {
  project = var.project
  zone    = var.zone
  name    = "${var.name}-server-data"
  type    = "pd-balanced"
  size    = var.data_disk_gb
  labels  = local.labels
  dynamic "disk_encryption_key" {
    for_each = var.kms_key_self_link == null ? [] : [var.kms_key_self_link]
    content {
      kms_key_self_link = disk_encryption_key.value
    }
  }
}

resource "google_compute_instance" "this" {
  #checkov:skip=CKV_GCP_38: CMEK is opt-in (kms_key_self_link); Google-managed keys encrypt the disks otherwise
  #checkov:skip=CKV_GCP_40: the server must have a public address: BOINC clients and browsers reach it
  project      = var.project
  zone         = var.zone
  name         = "${var.name}-server"
  machine_type = var.machine_type
  tags         = ["${var.name}-server"]
  labels       = local.labels

  boot_disk {
    kms_key_self_link = var.kms_key_self_link
    initialize_params {
      image = var.image
      size  = var.boot_disk_gb
      type  = "pd-balanced"
    }
  }

  attached_disk {
    source            = google_compute_disk.data.self_link
    device_name       = "bdl-data"
    kms_key_self_link = var.kms_key_self_link
  }

  network_interface {
    network    = var.network
    subnetwork = var.subnetwork
    access_config {
      nat_ip = google_compute_address.this.address
    }
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  service_account {
    email  = google_service_account.server.email
    scopes = ["cloud-platform"] # access is limited by IAM: the one secret
  }

  metadata = {
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    user-data = templatefile("${path.module}/../../cloud-init/server.yaml.tftpl", {
      cloud           = "gcp"
      region          = var.region
      redis_secret_id = google_secret_manager_secret.redis_password.id
      source_repo     = var.source_repo
      source_ref      = var.source_ref
      url_base        = local.url_base
      data_device     = "/dev/disk/by-id/google-bdl-data"
    })
  }

  depends_on = [google_secret_manager_secret_version.redis_password, google_secret_manager_secret_iam_member.server]
}
