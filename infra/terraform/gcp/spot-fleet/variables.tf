variable "name" {
  description = "Name of the SPOT managed instance group (e.g. bdl-gpu-spot); the on-demand twin is <on_demand_name>."
  type        = string
}

variable "project" {
  description = "GCP project id."
  type        = string
}

variable "zone" {
  description = "Zone of the managed instance group(s)."
  type        = string
}

variable "network" {
  description = "VPC network self link or name."
  type        = string
  default     = "default"
}

variable "subnetwork" {
  description = "Subnetwork self link or name; null uses the network's auto subnet."
  type        = string
  default     = null
}

variable "variant" {
  description = "gpu or cpu: which boinc-dl extra the hosts install (boinc-dl[gpu] or boinc-dl[cpu])."
  type        = string
  default     = "gpu"
  validation {
    condition     = contains(["gpu", "cpu"], var.variant)
    error_message = "variant must be gpu or cpu."
  }
}

variable "machine_type" {
  description = "Machine type of the hosts (e.g. g2-standard-4 for one L4, n2-standard-4 for CPU)."
  type        = string
}

variable "gpu_type" {
  description = "Accelerator to attach (e.g. nvidia-tesla-t4 on n1); null for CPU hosts and for machine types with built-in GPUs (g2, a2)."
  type        = string
  default     = null
}

variable "gpu_count" {
  description = "Number of gpu_type accelerators per host."
  type        = number
  default     = 1
}

variable "image" {
  description = "Boot image with cloud-init; for gpu, one with the NVIDIA driver (e.g. ubuntu-os-accelerator-images/ubuntu-accelerator-2204-amd64-with-nvidia-550)."
  type        = string
}

variable "boot_disk_gb" {
  description = "Boot disk size in GiB (image, venv, BOINC slots)."
  type        = number
  default     = 100
}

variable "kms_key_self_link" {
  description = "Cloud KMS key for the boot disks (CMEK); null uses Google-managed encryption."
  type        = string
  default     = null
}

variable "project_url" {
  description = "Master URL of the BOINC project the hosts attach to (the server module's project_url)."
  type        = string
}

variable "weak_key_secret_id" {
  description = "Secret Manager secret (projects/P/secrets/S) holding the project's weak account key."
  type        = string
}

variable "boinc_dl_requirement" {
  description = "pip requirement installed into /opt/boinc-dl/venv; null means boinc-dl[<variant>] from the package index."
  type        = string
  default     = null
  validation {
    condition     = var.boinc_dl_requirement == null || !can(regex("['\n]", var.boinc_dl_requirement))
    error_message = "boinc_dl_requirement must not contain a quote or a newline."
  }
}

variable "termination_action" {
  description = "What GCP does with a reclaimed SPOT VM: DELETE (the group recreates it) or STOP."
  type        = string
  default     = "DELETE"
  validation {
    condition     = contains(["DELETE", "STOP"], var.termination_action)
    error_message = "termination_action must be DELETE or STOP."
  }
}

variable "on_demand_name" {
  description = "Name of a second, on-demand group from the same image for the controller's fallback (fleet.yaml gcp.on_demand_mig); null creates none."
  type        = string
  default     = null
}

variable "controller_members" {
  description = "Extra IAM members (e.g. serviceAccount:bdl-server@P.iam.gserviceaccount.com) given the controller's roles, beside the controller service account this module creates."
  type        = list(string)
  default     = []
}

variable "labels" {
  description = "Labels added to the hosts and templates."
  type        = map(string)
  default     = {}
}
